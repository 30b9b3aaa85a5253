package idemq

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The README's quick start is examples/quickstart/main.go, and it runs.
func TestReadmeQuickStartRuns(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	example, err := os.ReadFile(filepath.Join("examples", "quickstart", "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	found := false
	for _, b := range blocks {
		if b[1] == string(example) {
			found = true
		}
	}
	if !found {
		t.Fatal("the README's quick start differs from examples/quickstart/main.go")
	}

	// Installed the way the README says: a module of its own with a replace.
	dir := t.TempDir()
	here, _ := os.Getwd()
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module quickstart\n\ngo 1.19\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), example, 0o644); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOTOOLCHAIN=local", "GOSUMDB=off")
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir, cmd.Env = dir, env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("go", "mod", "edit", "-require=github.com/idemq/idemq/clients/go@v0.0.0",
		"-replace=github.com/idemq/idemq/clients/go="+here)
	// The README's other Go blocks are functions: they compile beside it.
	var funcs []string
	for _, b := range blocks {
		if strings.HasPrefix(b[1], "func ") {
			funcs = append(funcs, b[1])
		}
	}
	if len(funcs) == 0 {
		t.Fatal("no function blocks found in the README")
	}
	snippets := "package main\n\nimport (\n\t\"errors\"\n\t\"log\"\n\n\t\"github.com/idemq/idemq/clients/go\"\n)\n\n" +
		"var _ = []any{errors.New, log.Printf, idemq.NewClient}\n\n" + strings.Join(funcs, "\n") +
		"\nvar _ = []any{" + strings.Join(funcNames(funcs), ", ") + "}\n"
	if err := os.WriteFile(filepath.Join(dir, "snippets.go"), []byte(snippets), 0o644); err != nil {
		t.Fatal(err)
	}
	run("go", "build", "-o", "quickstart", ".")
	cmd := exec.Command(filepath.Join(dir, "quickstart"))
	cmd.Env = append(os.Environ(), "IDEMQ_URL="+shared.url, "IDEMQ_TOKEN=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("quickstart: %v\n%s", err, out)
	}
	want := "accepted replayed true\nconflict with job true on [payload]\ncompleted {\"charge\":\"ch_inv_42\"}\n"
	if string(out) != want {
		t.Fatalf("quickstart printed\n%s\nwant\n%s", out, want)
	}
}

func funcNames(funcs []string) []string {
	var names []string
	for _, f := range funcs {
		names = append(names, regexp.MustCompile(`^func (\w+)`).FindStringSubmatch(f)[1])
	}
	return names
}
