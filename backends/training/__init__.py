"""Training the drafters on a frozen target, apart from the serving code (as DeepSpec keeps training apart
from modeling): the prompt mix, the target's own responses to it, their cached features, and the two
training loops. Nothing under ``backends/dspark`` imports from here; the trained folders are what it loads."""
