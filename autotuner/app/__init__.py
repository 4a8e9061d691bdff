"""The commands on top of everything else: the launcher's CLI, `--autotuning tune|run`,
`--bench`, and which engine a script trains on. Nothing below imports from here."""
