"""What users write and how it is replayed: definitions, graphs, schedule specs, replay."""
