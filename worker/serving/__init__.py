"""The serving layer: the Ray actor that owns a `Model`, its streams and its resume handles.
Imports nothing heavy at import time (the gateway names the actor class without torch)."""
