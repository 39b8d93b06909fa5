"""Reading request bodies that come either as multipart forms or as JSON.

Routes that take an image accept both: multipart/form-data with the image as a file
field (what a browser form and `curl -F image=@photo.jpg` send) or JSON with the image
base64-encoded (what a program sends along with a vector or a key). Both are parsed
here into one pydantic model plus the image bytes, with 4xx errors that name the
field; `openapi_body` documents the two forms for the OpenAPI schema.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from .errors import ApiError, validation_message
from .text import find_unencodable, text_problem

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ImageUpload:
    """An image a request carried: its bytes and the name errors call it by (the
    uploaded file's name when it is printable, else the field it came in)."""

    data: bytes
    name: str


MAX_FORM_FIELD_BYTES = 1024 * 1024
MAX_FORM_FIELDS = 64
JSON_FORM_FIELDS = ("metadata", "filter", "rerank")
"""Form fields that carry JSON text (an object), decoded before validation."""


async def read_body(
    request: Request, model: type[M], *, image_field: str | None = "image"
) -> tuple[M, ImageUpload | None]:
    """Parse the request into `model` and the image (None when none was sent).

    Multipart: form fields validate into `model`; `image_field` must be a file part.
    JSON: the object validates into `model`; its `image_base64` (if the model has
    one) is decoded into the image bytes.
    """
    parsed, images = await read_body_images(request, model, image_field=image_field)
    return parsed, images[0] if images else None


async def read_body_images(
    request: Request, model: type[M], *, image_field: str | None = "image", max_images: int = 1
) -> tuple[M, list[ImageUpload]]:
    """`read_body` for routes that take up to `max_images` images: the multipart
    `image_field` repeated, or in JSON `image_base64` or the list `images_base64`.
    More images than that is a 422 that says the limit."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        urlencoded = content_type == "application/x-www-form-urlencoded"
        parsed, images = await _read_form(request, model, image_field, urlencoded, max_images)
    elif content_type in ("application/json", ""):
        parsed, images = await _read_json(request, model)
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send multipart/form-data (or a urlencoded form) or application/json, "
            f"not {content_type!r}",
        )
    if len(images) > max_images:
        raise ApiError(
            422,
            "too_many_images",
            f"{len(images)} images sent; one query takes at most {max_images}",
        )
    return parsed, images


async def _read_form(
    request: Request, model: type[M], image_field: str | None, urlencoded: bool, max_images: int
) -> tuple[M, list[ImageUpload]]:
    if urlencoded:
        return _form_values(model, image_field, _parse_urlencoded(await request.body()))
    # one image: a second file part is refused by the parser; several: counted after,
    # so that a few too many are told the limit (the body limit bounds them all)
    form = await request.form(
        max_files=1 if max_images == 1 else MAX_FORM_FIELDS,
        max_fields=MAX_FORM_FIELDS,
        max_part_size=MAX_FORM_FIELD_BYTES,
    )
    try:
        fields: list[tuple[str, str | ImageUpload]] = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name != image_field:
                    raise ApiError(422, "invalid_request", f"unexpected file field {name!r}")
                fields.append((name, ImageUpload(await value.read(), _upload_name(value, name))))
            else:
                fields.append((name, value))
        return _form_values(model, image_field, fields)
    finally:
        await form.close()


def _parse_urlencoded(body: bytes) -> list[tuple[str, str]]:
    """A urlencoded body as (name, value) pairs; unlike the lenient parsers, bytes that
    are not UTF-8 (a percent-encoded surrogate, say) are refused, not replaced."""
    try:
        return parse_qsl(
            body.decode("ascii"),
            keep_blank_values=True,
            strict_parsing=False,
            encoding="utf-8",
            errors="strict",
            max_num_fields=MAX_FORM_FIELDS,
        )
    except UnicodeDecodeError:
        raise ApiError(
            422, "invalid_text", "the urlencoded body holds bytes that are not UTF-8 text"
        ) from None
    except ValueError as exc:  # too many fields
        raise ApiError(422, "invalid_request", f"the urlencoded body: {exc}") from None


def _upload_name(upload: UploadFile, field: str) -> str:
    """How errors name an uploaded file: its name when it is printable text."""
    name = upload.filename or ""
    if not name or len(name) > 200 or text_problem(name, controls=True):
        return f"the {field!r} upload"
    return repr(name)


def _form_values(
    model: type[M], image_field: str | None, fields: list[tuple[str, str | ImageUpload]]
) -> tuple[M, list[ImageUpload]]:
    """Form fields -> `model` and the images; a file part is the only non-text value."""
    values: dict[str, Any] = {}
    images: list[ImageUpload] = []
    for name, value in fields:
        if isinstance(value, ImageUpload):
            images.append(value)
        elif name == image_field:
            raise ApiError(
                422, "invalid_request", f"{name!r} must be a file part, not a text field"
            )
        elif name in values:
            raise ApiError(422, "invalid_request", f"field {name!r} is given twice")
        else:
            problem = text_problem(name) or text_problem(value)
            if problem:
                raise ApiError(422, "invalid_text", f"form field {name!r}: {problem}")
            values[name] = value
    for name in JSON_FORM_FIELDS:
        if name in values and name in model.model_fields:
            values[name] = _json_field(values[name], name)
    return _validate(model, values), images


async def _read_json(request: Request, model: type[M]) -> tuple[M, list[ImageUpload]]:
    raw = await request.body()
    if not raw:
        raise ApiError(422, "invalid_request", "the request body is empty")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too-long ints, nesting
        raise ApiError(400, "invalid_json", f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", "the JSON body must be an object")
    problem = find_unencodable(data)
    if problem:
        raise ApiError(422, "invalid_text", problem)
    parsed = _validate(model, data)
    one = getattr(parsed, "image_base64", None)
    several = getattr(parsed, "images_base64", None)
    if one is not None and several is not None:
        raise ApiError(
            422, "invalid_request", "give image_base64 (one image) or images_base64, not both"
        )
    if one is not None:
        return parsed, [ImageUpload(decode_base64(one, "image_base64"), "image_base64")]
    images = []
    for i, text in enumerate(several or ()):
        name = f"images_base64[{i}]"
        images.append(ImageUpload(decode_base64(text, name), name))
    return parsed, images


def decode_base64(text: str, field: str) -> bytes:
    if text.startswith("data:") and "," in text:  # a data: URL from a browser
        text = text.split(",", 1)[1]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(422, "invalid_base64", f"{field} is not valid base64") from None
    if not data:
        raise ApiError(422, "invalid_request", f"{field} is empty")
    return data


def _json_field(text: str, field: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ApiError(422, "invalid_request", f"{field} must be a JSON object") from None
    problem = find_unencodable(value, field)
    if problem:
        raise ApiError(422, "invalid_text", problem)
    return value


def _validate(model: type[M], values: dict[str, Any]) -> M:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        errors = [
            {"loc": list(e["loc"]), "msg": validation_message(e), "type": e["type"]}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        raise ApiError(422, "invalid_request", detail) from None


# -- OpenAPI ----------------------------------------------------------------------------


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references replaced by the definitions,
    so it can sit inside an OpenAPI operation without component bookkeeping."""
    schema = copy.deepcopy(schema)
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(copy.deepcopy(defs[ref.split("/")[-1]]))
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


def openapi_body(
    json_model: type[BaseModel], form_fields: dict[str, dict[str, Any]] | None
) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body and (when `form_fields` is given) the
    multipart form with the same meaning."""
    content: dict[str, Any] = {
        "application/json": {"schema": _inline_refs(json_model.model_json_schema())}
    }
    if form_fields is not None:
        content["multipart/form-data"] = {
            "schema": {"type": "object", "properties": form_fields},
            "encoding": {"image": {"contentType": "image/*"}},
        }
    return {"requestBody": {"required": True, "content": content}}


IMAGE_PART = {"type": "string", "format": "binary", "description": "the image file"}
