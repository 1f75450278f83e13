#!/usr/bin/env bash
# timeout: 240
# The two-box rehearsal (deploy/twobox.sh, also `make test-twobox`): two network namespaces
# joined by a veth pair, the mesh split across them over tcp://, membership, a request equal to
# the one-process answer, box B's owners failing and returning. Exits 77 (skip) where it cannot
# run (not root, no netns) and, until the gateway serves completions, after the membership,
# failure and rejoin checks passed with the request checks not run.
exec bash deploy/twobox.sh
