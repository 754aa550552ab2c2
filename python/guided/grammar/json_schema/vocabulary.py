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


# The keywords that constrain instances, by the JSON type they read ("any": every type). A key
# outside all of them (and not $defs) is ignored by validators, as unknown keywords are.
KEYWORDS_BY_TYPE = {
    "any": {"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
            "$ref", "$dynamicRef", "$recursiveRef"},
    "object": {"properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames", "dependencies",
               "dependentRequired", "dependentSchemas", "unevaluatedProperties"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
              "contains", "minContains", "maxContains", "unevaluatedItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}
