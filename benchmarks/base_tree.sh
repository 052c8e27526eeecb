#!/usr/bin/env bash
# Usage: bash benchmarks/base_tree.sh REV [DIR]
# Unpacks the project's code at git revision REV (jhybrid, pallas_kernels, benchmarks, converters) into DIR
# (default .ab/REV, git-ignored), so that one device call can time a change against the tree before it, both in
# the same process order on the same card: carry ".ab" and run the benchmark from inside the base tree, e.g.
#   (cd .ab/REV && python3 -m benchmarks.floors --json $OUT/base.json ...) ; python3 -m benchmarks.floors ...
# (`python -m` puts the working directory first on sys.path, so the base tree's packages are the ones imported.)
set -euo pipefail
rev="$1"
dir="${2:-.ab/$rev}"
rm -rf "$dir"
mkdir -p "$dir"
git archive "$rev" jhybrid pallas_kernels benchmarks converters | tar -x -C "$dir"
echo "$dir"
