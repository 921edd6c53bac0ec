// helmrender renders a Helm chart's templates the way `helm template` does, for CI machines that
// have no helm binary: Go's text/template with the sprig function library (both what Helm uses),
// plus Helm's own functions (include, tpl, required, toYaml, fromYaml, toJson, fromJson, lookup)
// and objects (.Values, .Release, .Chart, .Files, .Capabilities, .Template). Values are coalesced
// as Helm does (chart defaults, then each -f file in order; maps merge, null deletes) and pass
// through JSON like Helm's, so numbers are float64 there too.
//
// Not covered: hooks, CRDs, schema validation, library charts, `helm dependency` packaging.
// A subchart given with -subchart is rendered with its own .Values (the parent's values under the
// subchart's name coalesced over the subchart's defaults) and its named templates are visible to
// the parent, as with a dependency in charts/.
//
//	helmrender -chart DIR [-subchart NAME=DIR] [-f values.yaml]... [-release NAME] [-namespace NS]
//
// Prints every rendered manifest (NOTES.txt and partials excluded) as "# Source: ..." documents
// separated by "---"; exits 1 with the template error otherwise.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v2"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// Files is .Files: the chart's non-template files by path relative to the chart root.
type Files map[string][]byte

func (f Files) Get(name string) string      { return string(f[name]) }
func (f Files) GetBytes(name string) []byte { return f[name] }
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

type apiVersions []string

func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

type chart struct {
	name      string
	dir       string
	meta      map[string]interface{}
	values    map[string]interface{}
	files     Files
	templates []string // relative to dir, e.g. templates/deployment.yaml
}

// normalize turns yaml.v2's map[interface{}]interface{} into JSON-shaped data, as Helm's
// sigs.k8s.io/yaml does: string keys, float64 numbers.
func normalize(v interface{}) (interface{}, error) {
	v = stringKeys(v)
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var out interface{}
	err = json.Unmarshal(b, &out)
	return out, err
}

func stringKeys(v interface{}) interface{} {
	switch t := v.(type) {
	case map[interface{}]interface{}:
		m := map[string]interface{}{}
		for k, x := range t {
			m[fmt.Sprint(k)] = stringKeys(x)
		}
		return m
	case map[string]interface{}:
		for k, x := range t {
			t[k] = stringKeys(x)
		}
		return t
	case []interface{}:
		for i, x := range t {
			t[i] = stringKeys(x)
		}
		return t
	}
	return v
}

func readYAML(file string) (map[string]interface{}, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var raw interface{}
	if err := yaml.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("%s: %v", file, err)
	}
	n, err := normalize(raw)
	if err != nil {
		return nil, err
	}
	m, _ := n.(map[string]interface{})
	if m == nil {
		m = map[string]interface{}{}
	}
	return m, nil
}

// coalesce merges src over dst (src wins; maps merge; a null in src deletes the key).
func coalesce(dst, src map[string]interface{}) map[string]interface{} {
	out := map[string]interface{}{}
	for k, v := range dst {
		out[k] = v
	}
	for k, v := range src {
		if v == nil {
			delete(out, k)
			continue
		}
		dm, dok := out[k].(map[string]interface{})
		sm, sok := v.(map[string]interface{})
		if dok && sok {
			out[k] = coalesce(dm, sm)
		} else {
			out[k] = v
		}
	}
	return out
}

func loadChart(dir string) (*chart, error) {
	c := &chart{dir: dir, files: Files{}}
	var err error
	if c.meta, err = readYAML(filepath.Join(dir, "Chart.yaml")); err != nil {
		return nil, err
	}
	c.name, _ = c.meta["name"].(string)
	if c.values, err = readYAML(filepath.Join(dir, "values.yaml")); err != nil {
		return nil, err
	}
	err = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		if strings.HasPrefix(rel, "templates/") {
			c.templates = append(c.templates, rel)
			return nil
		}
		if strings.HasPrefix(rel, "charts/") {
			return nil
		}
		data, err := os.ReadFile(p)
		c.files[rel] = data
		return err
	})
	sort.Strings(c.templates)
	return c, err
}

func (c *chart) chartObject() map[string]interface{} {
	get := func(k string) interface{} { return c.meta[k] }
	return map[string]interface{}{
		"Name": get("name"), "Version": get("version"), "AppVersion": get("appVersion"),
		"Description": get("description"), "Type": get("type"), "APIVersion": get("apiVersion"),
	}
}

func main() {
	var chartDir, release, namespace string
	var valueFiles, subcharts listFlag
	flag.StringVar(&chartDir, "chart", "", "chart directory")
	flag.StringVar(&release, "release", "demo", "release name")
	flag.StringVar(&namespace, "namespace", "default", "release namespace")
	flag.Var(&valueFiles, "f", "values file (repeatable)")
	flag.Var(&subcharts, "subchart", "NAME=DIR of a dependency (repeatable)")
	flag.Parse()
	if err := run(chartDir, release, namespace, valueFiles, subcharts); err != nil {
		fmt.Fprintln(os.Stderr, "helmrender:", err)
		os.Exit(1)
	}
}

func run(chartDir, release, namespace string, valueFiles, subcharts []string) error {
	parent, err := loadChart(chartDir)
	if err != nil {
		return err
	}
	values := parent.values
	for _, f := range valueFiles {
		v, err := readYAML(f)
		if err != nil {
			return err
		}
		values = coalesce(values, v)
	}
	type unit struct {
		c      *chart
		values map[string]interface{}
	}
	units := []unit{{parent, values}}
	for _, s := range subcharts {
		name, dir, ok := strings.Cut(s, "=")
		if !ok {
			return fmt.Errorf("-subchart %q: want NAME=DIR", s)
		}
		sc, err := loadChart(dir)
		if err != nil {
			return err
		}
		mine, _ := values[name].(map[string]interface{})
		merged := coalesce(sc.values, mine)
		values[name] = merged // the parent sees the coalesced subchart values, as in Helm
		units = append(units, unit{sc, merged})
	}

	root := template.New("root").Option("missingkey=zero")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env")
	delete(funcs, "expandenv")
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var buf bytes.Buffer
		err := root.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = t.Execute(&buf, data)
		return strings.ReplaceAll(buf.String(), "<no value>", ""), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	funcs["toYaml"] = func(v interface{}) string {
		b, err := yaml.Marshal(v)
		if err != nil {
			return ""
		}
		return strings.TrimSuffix(string(b), "\n")
	}
	funcs["fromYaml"] = func(s string) map[string]interface{} {
		var raw interface{}
		if err := yaml.Unmarshal([]byte(s), &raw); err != nil {
			return map[string]interface{}{"Error": err.Error()}
		}
		n, _ := normalize(raw)
		m, _ := n.(map[string]interface{})
		return m
	}
	funcs["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	funcs["lookup"] = func(...interface{}) map[string]interface{} { return map[string]interface{}{} }
	root.Funcs(funcs)

	// Parse every template of every chart into one set, named "<chart>/templates/<file>".
	for _, u := range units {
		for _, rel := range u.c.templates {
			b, err := os.ReadFile(filepath.Join(u.c.dir, rel))
			if err != nil {
				return err
			}
			if _, err := root.New(u.c.name + "/" + rel).Parse(string(b)); err != nil {
				return err
			}
		}
	}
	caps := map[string]interface{}{
		"KubeVersion": map[string]interface{}{"Version": "v1.29.0", "Major": "1", "Minor": "29",
			"GitVersion": "v1.29.0"},
		"APIVersions": apiVersions{"v1", "apps/v1", "policy/v1", "monitoring.coreos.com/v1"},
	}
	var out strings.Builder
	for _, u := range units {
		for _, rel := range u.c.templates {
			base := path.Base(rel)
			if strings.HasPrefix(base, "_") || base == "NOTES.txt" && os.Getenv("HELMRENDER_NOTES") == "" {
				continue
			}
			name := u.c.name + "/" + rel
			data := map[string]interface{}{
				"Values": u.values, "Chart": u.c.chartObject(), "Files": u.c.files, "Capabilities": caps,
				"Release": map[string]interface{}{"Name": release, "Namespace": namespace, "Service": "Helm",
					"IsInstall": true, "IsUpgrade": false, "Revision": 1},
				"Template": map[string]interface{}{"Name": name, "BasePath": u.c.name + "/templates"},
			}
			var buf bytes.Buffer
			if err := root.ExecuteTemplate(&buf, name, data); err != nil {
				return err
			}
			text := strings.ReplaceAll(buf.String(), "<no value>", "")
			if strings.TrimSpace(text) == "" {
				continue
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", name, strings.Trim(text, "\n"))
		}
	}
	_, err = os.Stdout.WriteString(out.String())
	return err
}
