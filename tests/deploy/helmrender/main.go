// helmrender renders a Helm chart the way `helm template` does, for tests on machines
// without helm: Go's text/template with the sprig function library (what Helm itself
// uses), plus Helm's own functions (include, tpl, required, toYaml, fromYaml, toJson,
// fromJson, lookup) and the built-in objects (.Values, .Release, .Chart, .Capabilities,
// .Files, .Template). Values are coalesced like Helm: chart defaults, then each -f file in
// order, a null deleting a default. YAML goes through sigs.k8s.io/yaml (JSON numbers
// become float64), as in Helm.
//
// Not covered (see tests/deploy/README.md): subcharts and dependencies, hooks and the
// install order of kinds, .helmignore, Chart.yaml kubeVersion checks, lookup against a
// cluster (it returns an empty map, as `helm template` does), values.schema.json (the
// Python test validates values against it with jsonschema).
//
// Usage: helmrender [-f values.yaml]... [-api-versions g/v]... [-name R] [-namespace N]
//
//	[-notes] CHART_DIR
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig/v3"
	"sigs.k8s.io/yaml"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// VersionSet is .Capabilities.APIVersions.
type VersionSet []string

// Has reports whether an API group/version (or group/version/Kind) is available.
func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

// Files is .Files: the chart's non-template files.
type Files map[string][]byte

// Get returns a file's content as a string ("" if absent).
func (f Files) Get(name string) string { return string(f[name]) }

// GetBytes returns a file's content.
func (f Files) GetBytes(name string) []byte { return f[name] }

// Glob returns the files whose path matches pattern.
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

var defaultAPIVersions = VersionSet{
	"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v1", "autoscaling/v2",
	"networking.k8s.io/v1", "rbac.authorization.k8s.io/v1", "storage.k8s.io/v1",
	"apiextensions.k8s.io/v1", "coordination.k8s.io/v1", "discovery.k8s.io/v1",
}

func readYAMLMap(file string) (map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return out, nil
}

// coalesce merges src (lower priority) into dst like Helm's CoalesceTables: maps merge
// recursively, dst's scalars and lists win, and a null in dst deletes the key.
func coalesce(dst, src map[string]interface{}) map[string]interface{} {
	for key, sv := range src {
		dv, present := dst[key]
		if !present {
			dst[key] = sv
			continue
		}
		if dv == nil {
			delete(dst, key)
			continue
		}
		dm, dok := dv.(map[string]interface{})
		sm, sok := sv.(map[string]interface{})
		if dok && sok {
			dst[key] = coalesce(dm, sm)
		}
	}
	for key, dv := range dst {
		if dv == nil {
			delete(dst, key)
		}
	}
	return dst
}

func funcMap(t *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	included := map[string]int{}
	f["toYaml"] = func(v interface{}) string {
		data, err := yaml.Marshal(v)
		if err != nil {
			return ""
		}
		return strings.TrimSuffix(string(data), "\n")
	}
	f["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := yaml.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["toJson"] = func(v interface{}) string {
		data, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(data)
	}
	f["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return v, fmt.Errorf("%s", msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return v, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	f["lookup"] = func(string, string, string, string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	f["include"] = func(name string, data interface{}) (string, error) {
		if included[name] > 1000 {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		included[name]++
		defer func() { included[name]-- }()
		var buf strings.Builder
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	f["tpl"] = func(text string, vals map[string]interface{}) (string, error) {
		clone, err := t.Clone()
		if err != nil {
			return "", err
		}
		name := "tpl"
		if tm, ok := vals["Template"].(map[string]interface{}); ok {
			if n, ok := tm["Name"].(string); ok {
				name = n
			}
		}
		if _, err := clone.New(name).Parse(text); err != nil {
			return "", err
		}
		var buf strings.Builder
		err = clone.ExecuteTemplate(&buf, name, vals)
		return strings.ReplaceAll(buf.String(), "<no value>", ""), err
	}
	return f
}

func loadChart(dir string) (map[string]interface{}, Files, map[string]string, error) {
	meta, err := readYAMLMap(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, nil, nil, err
	}
	files := Files{}
	templates := map[string]string{}
	name, _ := meta["name"].(string)
	err = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.HasPrefix(rel, "templates/") {
			templates[path.Join(name, rel)] = string(data)
		} else {
			files[rel] = data
		}
		return nil
	})
	return meta, files, templates, err
}

func chartObject(meta map[string]interface{}) map[string]interface{} {
	// Helm exposes Chart.yaml's fields with capitalised names (.Chart.AppVersion).
	out := map[string]interface{}{}
	for k, v := range meta {
		out[strings.ToUpper(k[:1])+k[1:]] = v
	}
	return out
}

func main() {
	var valueFiles, apiVersions listFlag
	flag.Var(&valueFiles, "f", "values file (repeatable; later wins)")
	flag.Var(&apiVersions, "api-versions", "extra API version for .Capabilities (repeatable)")
	release := flag.String("name", "release-name", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	notes := flag.Bool("notes", false, "render templates/NOTES.txt instead of the manifests")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: helmrender [flags] CHART_DIR")
		os.Exit(2)
	}
	if err := run(flag.Arg(0), valueFiles, apiVersions, *release, *namespace, *notes); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

func run(dir string, valueFiles, apiVersions []string, release, namespace string,
	notes bool) error {
	meta, files, templates, err := loadChart(dir)
	if err != nil {
		return err
	}
	values, err := readYAMLMap(filepath.Join(dir, "values.yaml"))
	if err != nil {
		return err
	}
	for i := 0; i < len(valueFiles); i++ { // each file over what came before: the last wins
		user, err := readYAMLMap(valueFiles[i])
		if err != nil {
			return err
		}
		values = coalesce(user, values)
	}
	t := template.New("gotpl").Option("missingkey=zero")
	t.Funcs(funcMap(t))
	names := make([]string, 0, len(templates))
	for name := range templates {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if _, err := t.New(name).Parse(templates[name]); err != nil {
			return err
		}
	}
	chartName, _ := meta["name"].(string)
	top := map[string]interface{}{
		"Values": values,
		"Release": map[string]interface{}{
			"Name": release, "Namespace": namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Chart": chartObject(meta),
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{
				"Version": "v1.30.0", "GitVersion": "v1.30.0", "Major": "1", "Minor": "30",
			},
			"APIVersions": append(append(VersionSet{}, defaultAPIVersions...), apiVersions...),
			"HelmVersion": map[string]interface{}{"Version": "v3.16.0"},
		},
		"Files": files,
	}
	for _, name := range names {
		base := path.Base(name)
		isNotes := base == "NOTES.txt"
		if strings.HasPrefix(base, "_") || isNotes != notes {
			continue
		}
		vals := map[string]interface{}{}
		for k, v := range top {
			vals[k] = v
		}
		vals["Template"] = map[string]interface{}{
			"Name": name, "BasePath": path.Join(chartName, "templates"),
		}
		var buf strings.Builder
		if err := t.ExecuteTemplate(&buf, name, vals); err != nil {
			return err
		}
		out := strings.ReplaceAll(buf.String(), "<no value>", "")
		if notes {
			fmt.Print(out)
		} else if strings.TrimSpace(out) != "" {
			fmt.Printf("---\n# Source: %s\n%s\n", name, out)
		}
	}
	return nil
}
