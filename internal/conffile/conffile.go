// Package conffile reads infernode's line files (API keys, tenants' limits): a record a
// line, its fields separated by spaces, blank lines and # comments skipped.
package conffile

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strings"
)

// Read calls each with every record of the file at path (what names it in errors) and its
// line number; an error from each stops the reading and comes back prefixed with the
// file and line.
func Read(what, path string, each func(line int, fields []string) error) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := each(n, strings.Fields(line)); err != nil {
			return fmt.Errorf("%s %s:%d: %w", what, path, n, err)
		}
	}
	return sc.Err()
}
