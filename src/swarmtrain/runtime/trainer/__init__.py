"""The runtime of trainers: drive micro-batches through the stages (routing, retries, step tracking); never imports server code."""
