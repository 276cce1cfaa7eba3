#!/usr/bin/env bash
# The py3.12 x86-64 wheels the GPU image lacks (pydantic for lorarl.api, pytest-timeout), into
# .whl/ (ignored by git: `echo /.whl/ >> .git/info/exclude` once). Versions as in .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
  typing_extensions==4.16.0 pytest_timeout==2.4.0
