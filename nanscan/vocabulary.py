"""The words the monitor's incidents, logs and reports share: the phases of a step, in training
order, and the kinds of recorded tensors with the phrase each is reported by. Torch-free: the report
(:mod:`nanscan.report`), which must work where only a log is, imports it."""

# Training order within a step; "eval" is a forward outside training (no_grad, inference_mode,
# model.eval()) that ran after the step's update.
PHASES = ("forward", "loss", "backward", "update", "eval")
TRAINING_PHASES = PHASES[:4]
PHASE_ORDER = {phase: i for i, phase in enumerate(PHASES)}

KINDS = ("activation", "grad", "param", "buffer", "loss", "optimizer_state")
KIND_PHRASES = {"activation": "output of module", "grad": "gradient", "param": "parameter after the update",
                "buffer": "buffer after the update", "loss": "loss", "optimizer_state": "optimizer state"}
