"""The multi-node pieces: who talks to whom when training spans hosts.

- rendezvous.py: one decision for the master address, c10d/static backend and network interface
  of a multi-node launch (and the watch on node 0's store while training);
- hs_transport.py: how hidden states travel from the extraction server to the trainer (files on a
  shared path, or Mooncake), and the checks that the chosen path is reachable from every node.

Layer 3 (beside resolved/): may import core, data/, specdec/ and compat/; never engines/,
stages/ or cli/.
"""
