//go:build tools

// Test tooling only, never shipped: pins Helm for the chart's checks (integration/helm/build.sh).
package tools

import _ "helm.sh/helm/v4/cmd/helm"
