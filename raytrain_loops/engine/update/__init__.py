"""One optimizer update and its numerics: the engine and its step (:mod:`.step`), the decision to
apply or skip (:mod:`.decision`) and what a skip does (:mod:`.skips`), the errors and non-finite
detectors (:mod:`.guards`), autocast and the fp16 loss scaler (:mod:`.precision`)."""
