"""The speculators trainer's command line, launch, progress and failures."""
