#!/usr/bin/env bash
# Runs every test: installs and builds what is missing, then GoogleTest (C++, no Python) and pytest
# (through torch.compile). GPU tests skip themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash .ci/install.sh
echo "== deployment packages for the C++ tests (ember.export; the C++ side runs without Python)"
export EMBER_PACKAGE_TEST_DIR=${EMBER_PACKAGE_TEST_DIR:-$(mktemp -d)/packages}
"$PY" test/python/write_test_packages.py "$EMBER_PACKAGE_TEST_DIR" ${EMBER_PACKAGE_DEVICE:+--device "$EMBER_PACKAGE_DEVICE"}
echo "== C++ tests (GoogleTest, libtorch only)"
./build/py/test/cpp/ember_tests --gtest_brief=1
echo "== Python tests (pytest, torch.compile(backend=\"ember\"))"
cd test/python
"$PY" -m pytest -q -p no:cacheprovider "$@" .
