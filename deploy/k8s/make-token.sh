#!/usr/bin/env bash
# Writes the internal token for the Kubernetes manifests: 32 random bytes,
# hex, into deploy/k8s/base/internal-token (mode 600, gitignored), from which
# the base's secretGenerator makes the Secret `pdserve-internal-token`.
# Run it once per cluster, before `kubectl apply -k`; the token is never
# printed.
#
#   deploy/k8s/make-token.sh            write a token unless one is there
#   deploy/k8s/make-token.sh --rotate   replace it (the next apply rolls
#                                       every pod; docs/deploy.md)
#
# To use a token of your own: printf %s "$TOKEN" >deploy/k8s/base/internal-token
set -euo pipefail
FILE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/base/internal-token"
NAME="deploy/k8s/base/internal-token"

case "${1:-}" in
    "")
        if [[ -s "$FILE" ]]; then
            echo "$NAME exists; kept it (--rotate replaces it)"
            exit 0
        fi
        ;;
    --rotate) ;;
    *) echo "usage: make-token.sh [--rotate]" >&2; exit 2 ;;
esac

umask 077
tmp="$(mktemp "$FILE.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp"
if [[ "$(wc -c <"$tmp")" -ne 64 ]]; then
    echo "error: could not read 32 random bytes from /dev/urandom" >&2
    exit 1
fi
mv "$tmp" "$FILE"
echo "wrote a new internal token to $NAME (not printed)"
