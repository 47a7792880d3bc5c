"""Training, evaluation and the model card of TinyLoop-native looped models (`tinyloop train`)."""
