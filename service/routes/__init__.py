"""HTTP routes, one module per resource; ``api_router`` mounts them under /v1."""
from fastapi import APIRouter

from service.routes import adapters, evaluations, events, files, graders, health, jobs, models
from service.schemas import ERROR_RESPONSES

api_router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
for module in (files, jobs, events, evaluations, adapters, models, graders):
    api_router.include_router(module.router)

__all__ = ["api_router", "health"]
