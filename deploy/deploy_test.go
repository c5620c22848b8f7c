// Package deploy holds infernode's deployment files (a Dockerfile, Kubernetes manifests, a
// systemd unit); its tests check that they say what docs/DEPLOY.md promises and name
// only flags infernode has.
package deploy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// flags are the names of infernode's flags, read from its source.
func flags(t *testing.T) map[string]bool {
	t.Helper()
	src, err := os.ReadFile("../cmd/infernode/main.go")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, m := range regexp.MustCompile(`fs\.\w+Var\([^,]+, "([a-z0-9-]+)"`).FindAllSubmatch(src, -1) {
		out[string(m[1])] = true
	}
	if len(out) < 20 {
		t.Fatalf("found only %d flags in cmd/infernode/main.go: the pattern no longer matches", len(out))
	}
	return out
}

// checkArgs fails t for every --flag in args that infernode does not have.
func checkArgs(t *testing.T, where string, args []string, known map[string]bool) {
	t.Helper()
	for _, a := range args {
		if !strings.HasPrefix(a, "--") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !known[name] {
			t.Errorf("%s passes --%s, which infernode does not have", where, name)
		}
	}
}

// object is a Kubernetes object, as loosely as the checks need.
type object = map[string]any

func get(o any, path ...string) any {
	for _, p := range path {
		m, ok := o.(object)
		if !ok {
			return nil
		}
		o = m[p]
	}
	return o
}

func TestKubernetes(t *testing.T) {
	b, err := os.ReadFile("kubernetes/infernode.yaml")
	if err != nil {
		t.Fatal(err)
	}
	byKind := map[string][]object{}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var o object
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("infernode.yaml: %v", err)
		}
		if o != nil {
			byKind[o["kind"].(string)] = append(byKind[o["kind"].(string)], o)
		}
	}
	if len(byKind["StatefulSet"]) != 1 || len(byKind["PodDisruptionBudget"]) != 1 {
		t.Fatalf("want one StatefulSet and one PodDisruptionBudget, got %v", byKind)
	}
	sts := byKind["StatefulSet"][0]
	service := get(sts, "spec", "serviceName")
	var headless object
	for _, s := range byKind["Service"] {
		if get(s, "metadata", "name") == service {
			headless = s
		}
	}
	switch {
	case headless == nil:
		t.Fatalf("the StatefulSet's service %v is not defined", service)
	case get(headless, "spec", "clusterIP") != "None":
		t.Error("the peers' Service is not headless (clusterIP: None): its name would not resolve to every pod")
	case get(headless, "spec", "publishNotReadyAddresses") != true:
		t.Error("the peers' Service must publish pods that are not ready: a pod joins gossip before it is ready")
	}
	pod := get(sts, "spec", "template").(object)
	labels := get(pod, "metadata", "labels")
	for _, o := range []object{headless, byKind["PodDisruptionBudget"][0]} {
		sel := get(o, "spec", "selector")
		if m, ok := get(sel, "matchLabels").(object); ok {
			sel = m
		}
		for k, v := range sel.(object) {
			if get(labels, k) != v {
				t.Errorf("%s %v selects %s=%v, which the pods do not carry", get(o, "kind"), get(o, "metadata", "name"), k, v)
			}
		}
	}
	ann := get(pod, "metadata", "annotations")
	if get(ann, "prometheus.io/scrape") != "true" || get(ann, "prometheus.io/path") != "/metrics" {
		t.Errorf("the pods carry no Prometheus scrape annotations: %v", ann)
	}
	if get(pod, "spec", "securityContext", "runAsNonRoot") != true {
		t.Error("the pods may run as root")
	}
	c := get(pod, "spec", "containers").([]any)[0]
	var args []string
	for _, a := range get(c, "args").([]any) {
		args = append(args, a.(string))
	}
	checkArgs(t, "the StatefulSet", args, flags(t))
	joined := strings.Join(args, " ")
	if !strings.Contains(joined, "--join="+service.(string)+".") {
		t.Errorf("--join does not name the headless service %v: %s", service, joined)
	}
	if get(c, "readinessProbe", "httpGet", "path") != "/readyz" || get(c, "livenessProbe", "httpGet", "path") != "/healthz" {
		t.Error("readiness must probe /readyz and liveness /healthz")
	}
	secret := false
	for _, e := range get(c, "env").([]any) {
		if get(e, "name") == "INFERNODE_CLUSTER_SECRET" && get(e, "valueFrom", "secretKeyRef") != nil {
			secret = true
		}
	}
	if !secret {
		t.Error("the cluster secret does not come from a Secret")
	}
}

func TestDockerfile(t *testing.T) {
	b, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	stages := regexp.MustCompile(`(?m)^FROM `).FindAllString(df, -1)
	user := regexp.MustCompile(`(?m)^USER (\S+)`).FindStringSubmatch(df)
	switch {
	case len(stages) < 2:
		t.Error("not a multi-stage build: the image would carry the compiler")
	case !strings.Contains(df, "make build PORTABLE=1"):
		t.Error("the image is not built for the portable ISA: it would run only on CPUs like the builder's")
	case user == nil || strings.HasPrefix(user[1], "root") || strings.HasPrefix(user[1], "0"):
		t.Error("the image runs as root")
	case !strings.Contains(df, `VOLUME ["/models"]`):
		t.Error("the model is not a volume")
	}
	cmd := regexp.MustCompile(`(?m)^CMD \[(.*)\]`).FindStringSubmatch(df)
	if cmd == nil {
		t.Fatal("no CMD")
	}
	checkArgs(t, "the Dockerfile's CMD", strings.Split(strings.ReplaceAll(cmd[1], `"`, ""), ", "), flags(t))
}

func TestSystemd(t *testing.T) {
	known := flags(t)
	b, err := os.ReadFile("systemd/infernode.env")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		name, _, ok := strings.Cut(line, "=")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		flag := strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(name, "INFERNODE_"), "_", "-"))
		if !known[flag] {
			t.Errorf("infernode.env sets %s, but infernode has no --%s", name, flag)
		}
	}
	unit, err := os.ReadFile("systemd/infernode.service")
	if err != nil {
		t.Fatal(err)
	}
	exec := regexp.MustCompile(`(?m)^ExecStart=(.*)$`).FindStringSubmatch(string(unit))
	if exec == nil {
		t.Fatal("no ExecStart")
	}
	checkArgs(t, "the unit's ExecStart", strings.Fields(exec[1]), known)
}

// TestGrafana: the Grafana dashboard parses and queries only metrics infernode exports
// (their names read from the source).
func TestGrafana(t *testing.T) {
	b, err := os.ReadFile("grafana/infernode.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil || len(dash.Panels) == 0 {
		t.Fatalf("grafana/infernode.json: %v", err)
	}
	exported := map[string]bool{}
	name := regexp.MustCompile(`"(infernode_[a-z_]+)"`)
	filepath.WalkDir("../node", func(path string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			src, _ := os.ReadFile(path)
			for _, m := range name.FindAllSubmatch(src, -1) {
				exported[string(m[1])] = true
			}
		}
		return nil
	})
	used := regexp.MustCompile(`infernode_[a-z_]+`)
	for _, p := range dash.Panels {
		for _, q := range p.Targets {
			for _, m := range used.FindAllString(q.Expr, -1) {
				base := strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_count")
				if !exported[base] {
					t.Errorf("panel %q queries %s, which infernode does not export", p.Title, m)
				}
			}
		}
	}
}
