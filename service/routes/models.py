"""/v1/models: base models this deployment can train, and finished adapters as ``ft:`` models
(which DELETE removes, as OpenAI's API deletes a fine-tuned model)."""
from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import Session

from engine import registry
from service.auth import CurrentKey
from service import crud
from service.deps import ReleasingRoute, SessionDep, StoreDep
from service.errors import APIError, not_found
from service.models import Adapter
from service.routes.adapters import remove_adapter
from service.schemas import ListPage, Model, ModelDeleted
from service.views import unix

router = APIRouter(prefix="/models", tags=["models"], route_class=ReleasingRoute)


def _all(session: Session, project: str) -> list[Model]:
    base = [Model(id=e.name, created=0, owned_by=e.owned_by, qerl={"kind": "base", "hub_id": e.hub_id})
            for e in sorted(registry.registry().values(), key=lambda e: e.name)]
    adapters = session.scalars(select(Adapter).where(Adapter.project == project).order_by(Adapter.created_at.desc()))
    tuned = [Model(id=a.name, created=unix(a.created_at) or 0, owned_by=project,
                   qerl={"kind": "adapter", "adapter_id": a.id, "base_model": a.base_model, "job_id": a.job_id})
             for a in adapters]
    return base + tuned


@router.get("", response_model=ListPage[Model])
def list_models(key: CurrentKey, session: SessionDep) -> ListPage[Model]:
    return ListPage(data=_all(session, key.project))


@router.get("/{model_id:path}", response_model=Model)
def get_model(model_id: str, key: CurrentKey, session: SessionDep) -> Model:
    for m in _all(session, key.project):
        if m.id == model_id or m.id == registry.ALIASES.get(model_id):
            return m
    raise not_found("model", model_id, "model")


@router.delete("/{model_id:path}", response_model=ModelDeleted)
def delete_model(model_id: str, key: CurrentKey, session: SessionDep, store: StoreDep) -> ModelDeleted:
    """A fine-tuned model: its adapter (row and archive) goes. Base models belong to the deployment."""
    a = crud.get_adapter_by_name(session, key.project, model_id, for_update=True)
    if a is None:
        if model_id in registry.registry() or model_id in registry.ALIASES:
            raise APIError(422, f"Model {model_id!r} is a base model of this deployment; only fine-tuned models "
                                "(ft:...) can be deleted.", code="model_not_deletable", param="model")
        raise not_found("model", model_id, "model")
    remove_adapter(session, store, a)
    return ModelDeleted(id=model_id)
