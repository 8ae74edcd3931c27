"""Twenty JSON schemas covering the keywords people use, each with one valid instance.

Shared by the structured-output acceptance tests (every constrained reply must validate with
``jsonschema``) and ``scripts/bench_grammar.py`` (which backend compiles how many). Keywords:
nested objects, arrays with minItems/maxItems, enum, const, anyOf, oneOf, pattern, string
lengths, numbers with bounds, integers, booleans, null, additionalProperties false, required,
$ref/$defs (nested), format-free strings. Strings and integers are bounded where
the bundled 135M model would otherwise run past a test's ``max_tokens`` (its greedy digits and
nesting never stop).
"""

SCHEMAS: list[tuple[dict, object]] = [
    # 1. a flat object
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ann", "age": 3}),
    # 2. nested objects
    ({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False}},
      "required": ["user"], "additionalProperties": False},
     {"user": {"id": 1, "address": {"city": "Paris", "zip": "75001"}}}),
    # 3. an array with minItems / maxItems
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                "minItems": 2, "maxItems": 4}},
      "required": ["tags"], "additionalProperties": False},
     {"tags": ["a", "b"]}),
    # 4. enum
    ({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
      "required": ["colour"], "additionalProperties": False},
     {"colour": "red"}),
    # 5. anyOf
    ({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
      "required": ["value"], "additionalProperties": False},
     {"value": 4}),
    # 6. pattern
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
      "required": ["code"], "additionalProperties": False},
     {"code": "ABC-12"}),
    # 7. integer bounds
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
      "required": ["n"], "additionalProperties": False},
     {"n": 5}),
    # 8. number bounds (exclusive)
    ({"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
      "required": ["p"], "additionalProperties": False},
     {"p": 0.5}),
    # 9. $ref / $defs
    ({"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -100, "maximum": 100},
        "y": {"type": "number", "minimum": -100, "maximum": 100}}, "required": ["x", "y"], "additionalProperties": False}},
      "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
      "required": ["a", "b"], "additionalProperties": False},
     {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}),
    # 10. a root $ref and nested $refs (a two-level tree)
    ({"$defs": {"leaf": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 12}},
                         "required": ["label"], "additionalProperties": False},
                "node": {"type": "object", "properties": {
                    "label": {"type": "string", "maxLength": 12},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}},
                    "required": ["label", "children"], "additionalProperties": False}},
      "$ref": "#/$defs/node"},
     {"label": "root", "children": [{"label": "a"}]}),
    # 11. an array of objects
    ({"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
      "required": ["items"], "additionalProperties": False},
     {"items": [{"sku": "x1", "qty": 2}]}),
    # 12. booleans and null
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
      "required": ["ok", "note"], "additionalProperties": False},
     {"ok": True, "note": None}),
    # 13. string lengths
    ({"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 8}},
      "required": ["word"], "additionalProperties": False},
     {"word": "hello"}),
    # 14. const
    ({"type": "object", "properties": {"kind": {"const": "event"}, "id": {"type": "integer", "minimum": 0, "maximum": 999}},
      "required": ["kind", "id"], "additionalProperties": False},
     {"kind": "event", "id": 7}),
    # 15. oneOf of two object shapes
    ({"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"r": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "h": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["w", "h"], "additionalProperties": False}]}},
      "required": ["shape"], "additionalProperties": False},
     {"shape": {"r": 1.0}}),
    # 16. optional properties
    ({"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                       "rating": {"type": "number", "minimum": 0, "maximum": 10}},
      "required": ["title"], "additionalProperties": False},
     {"title": "Dune"}),
    # 17. a top-level array
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 5},
     [1, 2, 3]),
    # 18. an enum of mixed types and nullable field
    ({"type": "object", "properties": {"level": {"enum": [1, 2, "max"]}, "owner": {"type": ["string", "null"]}},
      "required": ["level", "owner"], "additionalProperties": False},
     {"level": "max", "owner": None}),
    # 19. a string-valued map with bounded keys
    ({"type": "object", "properties": {"scores": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "maxProperties": 3}},
      "required": ["scores"], "additionalProperties": False},
     {"scores": {"a": 1}}),
    # 20. the issue's parity shape: nested object, an enum and an array
    ({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                     "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
                    "required": ["name", "continent"], "additionalProperties": False},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
      "required": ["city", "country", "landmarks"], "additionalProperties": False},
     {"city": "Paris", "country": {"name": "France", "continent": "Europe"}, "landmarks": ["Louvre"]}),
]
