"""The web dashboard: one static page served at ``/`` that calls the JSON API from the browser.

The page asks for an API key and keeps it in the browser's localStorage; the server serves only
files (no session, no key). Charts use the vendored uPlot (MIT, ``static/vendor``), so nothing is
fetched from elsewhere at run time and there is no build step.
"""
from service.dashboard.routes import router

__all__ = ["router"]
