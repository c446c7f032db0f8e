"""The vocabulary every layer speaks: records, errors, keys, durations, validation, clock."""
