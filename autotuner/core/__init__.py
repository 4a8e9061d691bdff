"""What every layer shares and nothing of ours is imported by: the errors and their exit codes, the
records the tuner and the ranks exchange (boundary), atomic writes, dying with the parent, the
rank's process set-up, optuna's samplers behind one face (bayes) and the interleaved pick rule."""
