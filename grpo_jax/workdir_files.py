"""Names in a run's workdir that more than one module reads or writes (the others: README,
"Outputs and resume")."""

# A vmapped group's member that failed (TooManyBadSteps, MissingRewardsError) while the others
# went on: {"error", "message", "step"} (grpo_jax.sweep_runner reads it). A run that starts
# removes it.
FAILURE_FILE = "failed.json"
# A LoRA run's frozen base where its warm start made it (a Hugging Face checkpoint, written
# once): resuming reads it back, and a sweep's prefix hands it to the runs that start from it.
# Without a warm start the base is the initial model.
BASE_DIR = "base_model"
