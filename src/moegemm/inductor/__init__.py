"""torch.compile and Inductor: compile modes, custom-op autotuning registration, output-code inspection."""
