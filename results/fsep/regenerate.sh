#!/usr/bin/env bash
# Regenerates everything in results/fsep/: the simulator's comparison (sim.sh → sim.md) and the
# measured runs with their predictions, table and plots (measured.sh → measured.md, *.png,
# runs/, hardware.toml). About 10 minutes on the 2-core machine. Run from anywhere:
#   bash results/fsep/regenerate.sh [path/to/shared/traces]
# The environment of measured.sh applies (RUNS, PROFILE, KEEP).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bash "$here/sim.sh" "$@"
bash "$here/measured.sh"
