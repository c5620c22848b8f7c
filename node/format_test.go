package node

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/infernode/infernode/node/hop"
)

// TestResponseFormat: json_object and json_schema become the schema the engine enforces;
// a schema with a keyword llama.cpp's converter would silently ignore is refused (400)
// naming the keyword and where it is.
func TestResponseFormat(t *testing.T) {
	format := func(s string) *responseFormat {
		var f responseFormat
		if err := json.Unmarshal([]byte(s), &f); err != nil {
			t.Fatal(err)
		}
		return &f
	}
	for _, tc := range []struct {
		format, want, refused string
	}{
		{`{"type":"text"}`, "", ""},
		{`{"type":"json_object"}`, anyObject, ""},
		{`{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type":"object", "properties":{"a":{"type":"integer","minimum":0}},"required":["a"]}}}`,
			`{"type":"object","properties":{"a":{"type":"integer","minimum":0}},"required":["a"]}`, ""},
		{`{"type":"json_schema","json_schema":{"schema":{"$defs":{"x":{"type":"string","format":"date"}},"anyOf":[{"$ref":"#/$defs/x"},{"type":"null"}],"description":"d"}}}`,
			`{"$defs":{"x":{"type":"string","format":"date"}},"anyOf":[{"$ref":"#/$defs/x"},{"type":"null"}],"description":"d"}`, ""},
		{`{"type":"json_schema","json_schema":{"schema":{"type":"object","properties":{"n":{"type":"number","multipleOf":2}}}}}`, "", `"multipleOf" at /properties/n`},
		{`{"type":"json_schema","json_schema":{"schema":{"type":"array","uniqueItems":true}}}`, "", `"uniqueItems" at the root`},
		{`{"type":"json_schema","json_schema":{"schema":{"not":{"type":"string"}}}}`, "", `"not" at the root`},
		{`{"type":"json_schema","json_schema":{"schema":{"type":"number","maximum":3}}}`, "", `"maximum" at the root on a schema not of type integer`},
		{`{"type":"json_schema","json_schema":{"schema":{"type":"string","format":"email"}}}`, "", `format email`},
		{`{"type":"json_schema","json_schema":{"schema":{"items":[{"type":"string","patternProperties":{}}]}}}`, "", `"patternProperties" at /items/0`},
		{`{"type":"json_schema","json_schema":{"name":"x"}}`, "", "needs json_schema.schema"},
		{`{"type":"xml"}`, "", "must be text, json_object or json_schema"},
	} {
		got, err := format(tc.format).schema()
		switch {
		case tc.refused == "" && (err != nil || got != tc.want):
			t.Errorf("%s: %q, %v; want %q", tc.format, got, err, tc.want)
		case tc.refused != "" && (err == nil || !strings.Contains(err.Error(), tc.refused)):
			t.Errorf("%s: %v, want refused with %q", tc.format, err, tc.refused)
		case tc.refused != "":
			if e, ok := err.(*hop.Error); !ok || e.Status != 400 || e.Param != "response_format" {
				t.Errorf("%s: %#v, want a 400 on response_format", tc.format, err)
			}
		}
	}
}
