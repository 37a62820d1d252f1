"""What users see: the CLI, metrics and progress, reports, export, generated docs, the demo."""
