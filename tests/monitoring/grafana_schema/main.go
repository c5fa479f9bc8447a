// Command grafana-schema checks dashboard JSON files against Grafana's own dashboard schema, as the Grafana
// Foundation SDK generates it: a strict parse (an unknown field, a missing required one or a wrong type fails)
// and the schema's validation rules. Usage: grafana-schema FILE...; prints a line per file, exit 1 on a problem.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

// problem turns the SDK's answer into nil or an error: its strict parser returns an empty error list on success.
func problem(err error) error {
	var list cog.BuildErrors
	if errors.As(err, &list) && len(list) == 0 {
		return nil
	}
	return err
}

func check(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var board dashboard.Dashboard
	if err := problem(board.UnmarshalJSONStrict(raw)); err != nil {
		return err
	}
	return problem(board.Validate())
}

func main() {
	plugins.RegisterDefaultPlugins()
	failed := len(os.Args) < 2
	for _, path := range os.Args[1:] {
		if err := check(path); err != nil {
			fmt.Printf("%s: %v\n", path, err)
			failed = true
		} else {
			fmt.Printf("%s: valid\n", path)
		}
	}
	if failed {
		os.Exit(1)
	}
}
