#!/usr/bin/env bash
# Render every overlay into deploy/k8s/rendered/ (what `kubectl apply -k` would apply); the
# tests check these files against a fresh render and validate them against the API schemas.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p rendered
for overlay in overlays/*/; do
    name="$(basename "$overlay")"
    kubectl kustomize "$overlay" > "rendered/$name.yaml"
    echo "rendered/$name.yaml"
done
