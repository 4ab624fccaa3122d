"""Reward functions written as in TRL's GRPOTrainer documentation, to prove they run unchanged here."""

import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


async def async_reward(prompts, completions, completion_ids, **kwargs):
    return [None if len(ids) == 0 else 0.5 for ids in completion_ids]


def broken_reward(completions, **kwargs):
    raise RuntimeError("this plugin always fails")


def slow_length_reward(completions, **kwargs):
    import time

    time.sleep(0.2)
    return [float(len(str(c))) for c in completions]
