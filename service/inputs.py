"""Reading request bodies that come either as multipart forms or as JSON.

Routes that take an image accept both: multipart/form-data with the image as a file
field (what a browser form and `curl -F image=@photo.jpg` send) or JSON with the image
base64-encoded (what a program sends along with a vector or a key); a urlencoded form
is the multipart one without files. All are parsed here into one pydantic model plus
the image bytes, with 4xx errors that name the field.

A route declares its body once, as a `RequestBody`: the model and the image parts a
form carries. The same declaration reads requests and documents them, from the model's
JSON schema, so every limit and pattern is written once, in the model: the OpenAPI
`requestBody` is the JSON body, the model as a named component (one content type,
which client generators need); the forms (`form_schemas`: the model's fields, marked
`schemas.FormField` where a form sends JSON text or cannot send the field) are listed
in the operation's description.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from vitrieval.index.json_text import parse_json

from .errors import ApiError, validation_message
from .operations import operation
from .schemas import FormField
from .text import find_unencodable, text_problem

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ImageUpload:
    """An image a request carried: its bytes and the name errors call it by (the
    uploaded file's name when it is printable, else the field it came in)."""

    data: bytes
    name: str


MAX_FORM_FIELD_BYTES = 1024 * 1024
MAX_FORM_FIELDS = 64
JSON = "application/json"
MULTIPART = "multipart/form-data"
URLENCODED = "application/x-www-form-urlencoded"


@dataclass(frozen=True)
class RequestBody(Generic[M]):
    """What a route's body holds: `model`, and in a multipart form up to `max_images`
    file parts named `image_field` (None: no file part). `form_needs_image`: a form
    only succeeds with an image (what else the route needs is JSON only), so the
    urlencoded form, which cannot carry one, is not offered."""

    model: type[M]
    image_field: str | None = "image"
    max_images: int = 1
    form_needs_image: bool = False

    async def read(self, request: Request) -> tuple[M, list[ImageUpload]]:
        """The parsed body and its images (see `read_body_images`)."""
        return await read_body_images(
            request, self.model, image_field=self.image_field, max_images=self.max_images
        )

    async def read_one(self, request: Request) -> tuple[M, ImageUpload | None]:
        """`read` for a body with at most one image: the image or None."""
        parsed, images = await self.read(request)
        return parsed, images[0] if images else None

    def openapi(self) -> dict[str, Any]:
        """`openapi_extra` documenting the body: see `openapi_body`."""
        return openapi_body(self)

    def post(
        self,
        router: APIRouter,
        path: str,
        errors: Any,
        status_code: int = 200,
        method: str = "POST",
        **options: Any,
    ) -> Callable[[F], F]:
        """`router.post(path)` (or `method`) for a route that reads this body, declared by
        `operations.operation`: its name is the operation id, its docstring's first line the
        summary; `errors` the documented error statuses (`errors.error_responses(...)`)."""
        extra = self.openapi()
        return operation(router, method, path, errors, status_code, openapi_extra=extra, **options)


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
    for name, field in model.model_fields.items():
        if name in values and FormField.JSON_TEXT in field.metadata:
            values[name] = _json_field(values[name], name)
    return _validate(model, values), images


async def _read_json(request: Request, model: type[M]) -> tuple[M, list[ImageUpload]]:
    raw = await request.body()
    if not raw:
        raise ApiError(422, "invalid_request", "the request body is empty")
    try:
        data = parse_json(raw)
    except ValueError as exc:  # JSONDecodeError, too-long ints, nesting
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
        value = parse_json(text)
    except ValueError:
        raise ApiError(422, "invalid_request", f"{field} must be JSON text") from None
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


COMPONENTS = "x-vitrieval-components"
"""Where `openapi_body` leaves the schemas its `$ref`s name, in the operation; the
app's OpenAPI hook (service/openapi.py) moves them under components/schemas."""
REF_TEMPLATE = "#/components/schemas/{model}"


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references replaced by the definitions,
    so a form field's JSON text can state its decoded value in one schema."""
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


def openapi_body(body: RequestBody[Any]) -> dict[str, Any]:
    """`openapi_extra` for a route reading `body`: the JSON body as a `$ref` to the model
    (its schema and the models it refers to under `COMPONENTS`), and a description of
    the forms the route also reads. Builds the forms' schemas, so a field a form cannot
    carry fails here, when the route is declared."""
    name = body.model.__name__
    schema = body.model.model_json_schema(ref_template=REF_TEMPLATE)
    components = {name: schema, **schema.pop("$defs", {})}
    return {
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": {"$ref": REF_TEMPLATE.format(model=name)}}},
        },
        "description": forms_description(body),
        COMPONENTS: components,
    }


def form_schemas(body: RequestBody[Any]) -> dict[str, dict[str, Any]]:
    """The forms a route reading `body` accepts, by content type, as JSON schemas from
    the model's: a multipart form (with the image parts) and, when a form without a
    file can succeed, a urlencoded one."""
    schema = _inline_refs(body.model.model_json_schema())
    fields = _form_fields(body.model, schema)
    required = [name for name in schema.get("required", ()) if name in fields]
    multipart_fields = dict(fields)
    if body.image_field is not None:
        multipart_fields = {body.image_field: _image_part(body.max_images), **fields}
        if body.form_needs_image:
            required = [body.image_field, *required]
    forms = {MULTIPART: _form_schema(schema, multipart_fields, required)}
    if body.image_field is None or not body.form_needs_image:
        forms[URLENCODED] = _form_schema(schema, fields, required)
    return forms


def forms_description(body: RequestBody[Any]) -> str:
    """Markdown for the operation's description: the forms the route reads besides
    JSON, and their fields (the JSON schema states each field's limits)."""
    lines = []
    for content_type, form in form_schemas(body).items():
        required = set(form.get("required", ()))
        fields = []
        for name, field in form["properties"].items():
            kind = _form_field_kind(field)
            fields.append(f"`{name}` ({kind}{', required' if name in required else ''})")
        lines.append(f"- `{content_type}`: {', '.join(fields)}")
    image = f", the image as the file part `{body.image_field}`" if body.image_field else ""
    return (
        f"The body may also be a form with the JSON body's fields{image}; objects and "
        f"lists are JSON text:\n\n" + "\n".join(lines)
    )


def _form_field_kind(field: dict[str, Any]) -> str:
    if field.get("format") == "binary":
        return "file"
    if field.get("items", {}).get("format") == "binary":
        return f"file, repeated for up to {field['maxItems']}"
    if field.get("contentMediaType") == JSON:
        return "JSON text"
    return "text"


def _form_schema(
    schema: dict[str, Any], fields: dict[str, dict[str, Any]], required: list[str]
) -> dict[str, Any]:
    form: dict[str, Any] = {"type": "object", "properties": fields, "additionalProperties": False}
    if required:
        form["required"] = required
    for keyword in ("title", "description"):
        if keyword in schema:
            form[keyword] = schema[keyword]
    return form


def _form_fields(model: type[BaseModel], schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The model's fields as a form sends them: text (numbers, booleans and enums as
    their text), JSON text for the fields marked so; fields marked JSON only left out."""
    fields: dict[str, dict[str, Any]] = {}
    for name, field in model.model_fields.items():
        if FormField.JSON_ONLY in field.metadata:
            continue
        value = _not_null(schema["properties"][name])
        if FormField.JSON_TEXT in field.metadata:
            value = _json_text(value)
        elif value.get("type") not in ("string", "integer", "number", "boolean"):
            raise TypeError(
                f"{model.__name__}.{name} cannot be one form field: mark it "
                f"FormField.JSON_TEXT or FormField.JSON_ONLY"
            )
        fields[name] = value
    return fields


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional field's schema without its `null` (a form leaves the field out)."""
    schema = {key: value for key, value in schema.items() if value is not None}
    options = [option for option in schema.pop("anyOf", ()) if option != {"type": "null"}]
    if len(options) > 1:
        return {"anyOf": options, **schema}
    return {**options[0], **schema} if options else schema


def _json_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON-valued field as a form field: JSON text whose decoded value is `schema`."""
    text: dict[str, Any] = {"type": "string", "contentMediaType": JSON}
    content = {key: value for key, value in schema.items() if key not in ("title", "examples")}
    content.pop("description", None)
    text["contentSchema"] = content
    if "title" in schema:
        text["title"] = schema["title"]
    if "description" in schema:
        text["description"] = f"JSON text: {schema['description']}"
    if "examples" in schema:
        text["examples"] = [json.dumps(example) for example in schema["examples"]]
    return text


def _image_part(max_images: int) -> dict[str, Any]:
    part = {"type": "string", "format": "binary", "description": "the image file"}
    if max_images == 1:
        return part
    return {
        "type": "array",
        "items": part,
        "minItems": 1,
        "maxItems": max_images,
        "description": f"the image file; repeat the part for several images searched as "
        f"one query (at most {max_images})",
    }
