// Command testreport reads `go test -json` on stdin, echoes the tests'
// output, and ends with one line
//
//	test result: ok. N passed; M failed; 0 ignored
//
// counting every test and subtest once. It exits 1 when anything failed,
// including a package that failed outside any test (a build error, a setup
// failure in TestMain, a panic).
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"strings"
)

type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

func main() {
	label := ""
	if len(os.Args) > 1 {
		label = os.Args[1]
	}
	var passed, failed, skipped int
	failedIn := map[string]int{}
	pkgFailed := map[string]bool{}
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	out := bufio.NewWriter(os.Stdout)
	for sc.Scan() {
		line := sc.Text()
		var ev event
		if !strings.HasPrefix(line, "{") || json.Unmarshal([]byte(line), &ev) != nil {
			fmt.Fprintln(out, line) // not an event: a build error, say
			if strings.HasPrefix(line, "FAIL") || strings.Contains(line, "build failed") {
				pkgFailed["(build)"] = true
			}
			continue
		}
		switch ev.Action {
		case "output":
			fmt.Fprint(out, ev.Output)
		case "pass", "fail", "skip":
			if ev.Test == "" {
				if ev.Action == "fail" {
					pkgFailed[ev.Package] = true
				}
				continue
			}
			switch ev.Action {
			case "pass":
				passed++
			case "fail":
				failed++
				failedIn[ev.Package]++
			case "skip":
				skipped++
			}
		}
		out.Flush()
	}
	// A package that failed without a failing test still counts as a failure.
	for pkg := range pkgFailed {
		if failedIn[pkg] == 0 {
			failed++
		}
	}
	status := "ok"
	if failed > 0 {
		status = "FAILED"
	}
	if label != "" {
		fmt.Fprintf(out, "go client suite (%s):\n", label)
	}
	fmt.Fprintf(out, "test result: %s. %d passed; %d failed; %d ignored\n", status, passed, failed, skipped)
	out.Flush()
	if failed > 0 {
		os.Exit(1)
	}
}
