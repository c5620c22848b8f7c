package node

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Structured outputs: response_format {"type": "json_object"} or {"type": "json_schema",
// "json_schema": {"schema": ...}} on chat and completions. The engine compiles the schema
// to a grammar with llama.cpp's converter and samples every token among those the grammar
// allows, so every answer that ends (finish_reason "stop") matches the schema. The
// converter silently ignores keywords it cannot express, so a schema is first checked
// against the keywords it does enforce, and one using any other is refused, by name.

// responseFormat is a request's response_format.
type responseFormat struct {
	Type       string `json:"type"` // text, json_object or json_schema
	JSONSchema *struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		Schema      json.RawMessage `json:"schema"`
		Strict      *bool           `json:"strict"` // every schema is enforced strictly
	} `json:"json_schema"`
}

// anyObject is json_object's schema: any JSON object.
const anyObject = `{"type":"object"}`

// schema is the JSON schema f enforces ("" for none), compact.
func (f *responseFormat) schema() (string, error) {
	if f == nil {
		return "", nil
	}
	switch f.Type {
	case "", "text":
		return "", nil
	case "json_object":
		return anyObject, nil
	case "json_schema":
	default:
		return "", badRequest("response_format", "response_format type must be text, json_object or json_schema, got %q", f.Type)
	}
	if f.JSONSchema == nil || len(f.JSONSchema.Schema) == 0 {
		return "", badRequest("response_format", "response_format json_schema needs json_schema.schema")
	}
	var doc any
	if err := json.Unmarshal(f.JSONSchema.Schema, &doc); err != nil {
		return "", badRequest("response_format", "json_schema.schema is not JSON: %v", err)
	}
	if err := checkSchema(doc, ""); err != nil {
		return "", badRequest("response_format", "json_schema.schema %v", err)
	}
	var b bytes.Buffer
	if err := json.Compact(&b, f.JSONSchema.Schema); err != nil {
		return "", badRequest("response_format", "json_schema.schema: %v", err)
	}
	return b.String(), nil
}

// Keywords of a schema: those llama.cpp's converter enforces, those that only annotate,
// and where schemas nest.
var (
	enforced = []string{"type", "properties", "required", "additionalProperties", "items", "prefixItems",
		"minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
		"pattern", "minLength", "maxLength", "format"}
	annotations = []string{"title", "description", "default", "examples", "$schema", "$id", "$comment",
		"deprecated", "readOnly", "writeOnly"}
	// Range keywords are enforced on integers only.
	integerRanges = []string{"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
	// Formats the converter knows (others it ignores).
	formats = []string{"date", "time", "date-time", "uuid"}
)

// checkSchema refuses a schema (at JSON pointer at) that uses a keyword the converter
// would not enforce.
func checkSchema(v any, at string) error {
	switch s := v.(type) {
	case bool:
		return nil // true: anything; false: nothing
	case map[string]any:
		integer := s["type"] == "integer"
		for _, k := range slices.Sorted(maps.Keys(s)) {
			val := s[k]
			switch {
			case slices.Contains(annotations, k):
			case slices.Contains(integerRanges, k):
				if !integer {
					return fmt.Errorf("uses %q at %s on a schema not of type integer, which infernode does not enforce", k, pointer(at))
				}
			case k == "format":
				if f, _ := val.(string); !slices.Contains(formats, f) {
					return fmt.Errorf("uses format %v at %s, which infernode does not enforce (it enforces %s)", val, pointer(at), strings.Join(formats, ", "))
				}
			case !slices.Contains(enforced, k):
				return fmt.Errorf("uses %q at %s, which infernode does not enforce: it enforces %s", k, pointer(at), strings.Join(enforced, ", "))
			}
			if err := checkNested(k, val, at+"/"+k); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("at %s is %T, not a schema", pointer(at), v)
}

// checkNested checks the schemas keyword k holds.
func checkNested(k string, v any, at string) error {
	switch k {
	case "properties", "$defs", "definitions":
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("at %s is not an object", pointer(at))
		}
		for name, sub := range m {
			if err := checkSchema(sub, at+"/"+name); err != nil {
				return err
			}
		}
	case "items", "additionalProperties":
		if list, ok := v.([]any); ok && k == "items" { // the old tuple form
			return checkList(list, at)
		}
		return checkSchema(v, at)
	case "prefixItems", "anyOf", "oneOf", "allOf":
		list, ok := v.([]any)
		if !ok {
			return fmt.Errorf("at %s is not an array", pointer(at))
		}
		return checkList(list, at)
	}
	return nil
}

func checkList(list []any, at string) error {
	for i, sub := range list {
		if err := checkSchema(sub, fmt.Sprintf("%s/%d", at, i)); err != nil {
			return err
		}
	}
	return nil
}

func pointer(at string) string {
	if at == "" {
		return "the root"
	}
	return at
}
