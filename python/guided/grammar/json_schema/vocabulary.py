"""The JSON Schema vocabulary the sanitiser knows: annotations, types, drafts and their keywords."""
from __future__ import annotations


# Keywords with no effect on which instances validate.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "$comment", "default", "deprecated",
    "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema",
    "x-guidance", "discriminator", "nullable_note", "markdownDescription", "errorMessage",
    "enumDescriptions", "markdownEnumDescriptions", "deprecationMessage", "$vocabulary",
})

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")

DRAFTS = {
    "http://json-schema.org/draft-04/schema": 4,
    "http://json-schema.org/draft-06/schema": 6,
    "http://json-schema.org/draft-07/schema": 7,
    "https://json-schema.org/draft/2019-09/schema": 2019,
    "https://json-schema.org/draft/2020-12/schema": 2020,
}


# Keywords introduced after draft 4 (validators of an older draft ignore them, so we drop them).
KW_SINCE = {
    "const": 6, "contains": 6, "propertyNames": 6, "$id": 6, "if": 7, "then": 7, "else": 7,
    "$defs": 2019, "$anchor": 2019, "dependentRequired": 2019, "dependentSchemas": 2019,
    "maxContains": 2019, "minContains": 2019, "prefixItems": 2020, "unevaluatedItems": 2019,
    "unevaluatedProperties": 2019,
}
