"""Ray Tune sweeps over Train runs, on the driver: the search, one Train run per trial
(:mod:`.tune`), the results table, the best recipe and the plot (:mod:`.results`)."""
