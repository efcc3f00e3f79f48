"""What the policy learns and is graded on: prompt sets and benchmarks, rewards and their grader
workers, the tiny model and tokenizer built locally, the column-addition task."""
