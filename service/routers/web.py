"""GET /: the search page (one self-contained HTML file with its script)."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["web"])


@lru_cache
def _page() -> str:
    return files("vitrieval.service").joinpath("static/index.html").read_text(encoding="utf-8")


@router.get(
    "/",
    operation_id="get_page",
    response_class=HTMLResponse,
    summary="Search by image in the browser",
)
async def page() -> HTMLResponse:
    return HTMLResponse(_page())
