"""``GET /wallet/{user_id}/api-credit`` and ``/package``: a local server has unlimited credit.

The objects carry every field both SDKs validate: ``_id`` (the new SDK's ``Package`` requires
it although the OpenAPI omits it), decimal-string ``credit``, and a string ``finished_at``
(the legacy ``PackageEntity`` requires a non-null one).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .state import get_state

router = APIRouter()

UNLIMITED_CREDIT = "1000000000.00"
UNLIMITED_UNITS = 2**31 - 1
EPOCH = "2024-01-01T00:00:00Z"
NEVER = "9999-12-31T23:59:59Z"


@router.head("/wallet/{user_id}/api-credit", include_in_schema=False)
@router.get("/wallet/{user_id}/api-credit", summary="API credit (unlimited on a local server)")
async def api_credit(user_id: str, request: Request) -> JSONResponse:
    get_state(request).auth.check(request)
    return JSONResponse({
        "_id": "shoal-local-credit", "user_id": user_id, "credit": UNLIMITED_CREDIT,
        "cumulative_top_up": "0", "created_at": EPOCH, "updated_at": EPOCH,
        "has_phone_sha256": False, "has_free_credit": False,
    })


@router.head("/wallet/{user_id}/package", include_in_schema=False)
@router.get("/wallet/{user_id}/package", summary="Package (unlimited on a local server)")
async def package(user_id: str, request: Request) -> JSONResponse:
    get_state(request).auth.check(request)
    return JSONResponse({
        "_id": "shoal-local-package", "user_id": user_id, "type": "shoal-local",
        "total": UNLIMITED_UNITS, "balance": UNLIMITED_UNITS,
        "created_at": EPOCH, "updated_at": EPOCH, "finished_at": NEVER,
    })
