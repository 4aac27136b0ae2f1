"""Launchers: how a run (or one stage) is handed to a cluster's scheduler instead of run here.

- slurm_script.py: the one batch script for the recipe's whole topology (which node runs which
  server, the Mooncake master, the trainer nodes under torchrun, start-up order, health waits), a
  pure function of the recipe, the run folder's state and the command line;
- slurm_job.py: submit it with sbatch, follow the job (squeue/scontrol and the job's log in the
  run folder), cancel it on Ctrl-C, and turn its end into an exit code and one line.

Layer 6.5 (above stages/, below cli/): may import core, data/, specdec/, compat/, resolved/,
distributed/, engines/, measure/ and stages/; never cli/.
"""
