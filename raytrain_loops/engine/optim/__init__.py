"""What an update applies: parameter groups and the optimizer (:mod:`.optimizer`), the lr and
weight-decay schedules (:mod:`.schedules`), the EMA of the weights (:mod:`.ema`), gradient clipping
(:mod:`.clip`)."""
