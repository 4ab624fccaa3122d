"""bench/vs_trl.py's reading of a run: training records apart from evaluation records, and the window from the
first generation request to the end of the last optimizer step."""

from __future__ import annotations

import pytest

from bench import vs_trl as bench


def _step(step: int, time: float, **seconds: float) -> dict:
    timings = {"seconds/step": 10.0, "seconds/wait": 3.0, "seconds/train_wall": 5.0} | seconds
    return {"step": step, "time": time, "reward": 0.1 * step, "completion_tokens": 100.0, **timings}


def test_evaluation_records_are_not_read_as_training_steps():
    records = [
        {"step": 0, "time": 1.0, "eval/reward": 0.2, "eval/seconds": 4.0},
        _step(1, 20.0),
        _step(2, 30.0),
        {"step": 2, "time": 31.0, "eval/reward": 0.4, "eval/seconds": 4.0},
    ]
    assert [r["step"] for r in bench.training_records(records)] == [1, 2]
    assert [r["eval/reward"] for r in bench.evaluation_records(records)] == [0.2, 0.4]


def test_a_file_without_training_records_is_an_error_naming_the_keys_seen():
    with pytest.raises(ValueError, match=r"no training record.*'eval/reward'"):
        bench.training_records([{"step": 0, "time": 1.0, "eval/reward": 0.2}])


def test_the_window_runs_from_the_first_sampling_start_to_the_last_steps_training_end():
    steps = [_step(1, 20.0), _step(2, 40.0, **{"seconds/step": 12.0, "seconds/wait": 1.0, "seconds/train_wall": 6.0})]
    batches = [
        {"step": 1, "sampling_started_at": [7.5, 6.0], "sampling_finished_at": [9.0, 9.5]},
        {"step": 2, "sampling_started_at": [15.0, 14.0], "sampling_finished_at": [30.0, 31.0]},
    ]
    # the last record is written 12 s after its step began: 1 s waiting, 6 s training, then 5 s of push,
    # checkpoint and evaluation, which the window leaves out
    assert bench.training_window(steps, batches) == (6.0, 35.0)


def test_the_final_reward_is_the_mean_of_the_last_three_steps():
    assert bench.final_reward([0.0, 0.3, 0.6, 0.9]) == pytest.approx(0.6)
    assert bench.final_reward([0.5]) == 0.5


def test_the_judge_s_problems_are_no_training_row_of_any_seed_and_the_same_every_time():
    from bench.held_out import held_out_problems
    from bench.trl_side import load_demo
    from shared.config.data import DataSettings
    from shared.dataset.sources import _builtin_task

    demo = load_demo()
    problems = held_out_problems(demo, 50, [0, 1])
    assert len(problems) == 50 and problems == held_out_problems(demo, 50, [0, 1])
    operand = demo["data"]["builtin_max_operand"]
    runs = [DataSettings(builtin_size=2000, builtin_max_operand=operand, shuffle_seed=seed) for seed in (0, 1)]
    training = {row["question"] for data in runs for row in _builtin_task("arithmetic", data)}  # as a run reads it
    assert not training & {p["question"] for p in problems}
    assert len({p["question"] for p in problems}) == 50


def test_a_child_s_figures_are_its_last_line_when_that_is_a_json_object():
    assert bench.last_json_line('progress\n{"reward": 0.5}\n') == {"reward": 0.5}
    assert bench.last_json_line('{"reward": 0.5}\nTraceback (most recent call last): ...') is None
    assert bench.last_json_line('{"reward": 0.5}\n\n  \n') == {"reward": 0.5}
    assert bench.last_json_line('{"reward": 0.5}\n{"cut off') is None
    assert bench.last_json_line("") is None


def test_the_summary_ranks_systems_by_the_judge_s_reward_and_keeps_the_training_tail():
    rows = [
        {
            "seconds": 10.0,
            "rewards": [0.1, 0.2, 0.3, 0.9],
            "completion_tokens": 100.0,
            "held_out": {"reward": 0.5, "correct": 0.4},
        },
        {
            "seconds": 20.0,
            "rewards": [0.0, 0.0, 0.0, 0.3],
            "completion_tokens": 300.0,
            "held_out": {"reward": 0.7, "correct": 0.6},
        },
    ]
    figures = bench.summary(rows, steps=4)
    assert figures["held_out_reward"] == pytest.approx(0.6) and figures["held_out_correct"] == pytest.approx(0.5)
    assert figures["final_reward"] == pytest.approx((0.2 + 0.3 + 0.9 + 0.0 + 0.0 + 0.3) / 6)
    assert figures["seconds"] == 15.0 and figures["tokens_per_s"] == pytest.approx(12.5)


@pytest.mark.parametrize(
    ("rendering", "ending"),
    [
        ("continue", "<|im_start|>assistant\n<think>"),  # ours and TRL's GRPOTrainer: the prefill is continued
        ("no-prefill", "?<|im_end|>\n<|im_start|>assistant\n"),  # TRL's async trainer: no prefill at all
    ],
)
def test_the_judge_asks_each_model_as_its_system_rendered_the_prompt(rendering, ending):
    from bench.held_out import prompt_text
    from bench.trl_side import load_demo
    from tests.support.tiny_model import build_tokenizer

    text = prompt_text(build_tokenizer(), load_demo(), "How many?", rendering)
    assert text.endswith(ending) and text.count("How many?") == 1
    assert text.startswith("<|im_start|>system\n")


def test_an_unknown_rendering_is_refused():
    from bench.held_out import prompt_text
    from bench.trl_side import load_demo
    from tests.support.tiny_model import build_tokenizer

    with pytest.raises(ValueError, match="none of continue, no-prefill"):
        prompt_text(build_tokenizer(), load_demo(), "How many?", "generation-prompt")


def test_trl_s_grpotrainer_gets_our_generator_s_prompt_ids():
    """The text prompts TRL tokenizes as they are (``tokenizer(text)``) give the ids our generator sends vLLM
    for the same chat, the prefill continued."""
    from bench.trl_side import demo_rows, load_demo, rendered_dataset
    from services.generator.engine import Engine
    from shared.trajectory import ChatMessage
    from tests.support.tiny_model import build_tokenizer

    demo, tokenizer = load_demo(), build_tokenizer()
    dataset = rendered_dataset(demo, tokenizer)
    rows = demo_rows(demo)
    assert len(dataset) == len(rows) and dataset["answer"][:3] == [row["answer"] for row in rows[:3]]
    data = demo["data"]
    chat = (
        ChatMessage(role="system", content=data["system_prompt"]),
        *(ChatMessage(**m) for m in data["examples"]),
        ChatMessage(role="user", content=rows[0]["question"]),
        ChatMessage(role="assistant", content=data["assistant_prefill"]),
    )
    generator = Engine.__new__(Engine)
    generator.tokenizer = tokenizer
    assert tokenizer(dataset["prompt"][0])["input_ids"] == generator.tokenize(chat)
    assert dataset["prompt"][0].endswith("<|im_start|>assistant\n<think>")


def test_a_tokenizer_that_would_change_the_prompt_ids_is_refused():
    from bench.trl_side import load_demo, rendered_dataset
    from tests.support.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", tokenizer.convert_tokens_to_ids("<|im_start|>"))]
    )  # a BOS-like token added to plain text only
    with pytest.raises(ValueError, match="otherwise than our generator"):
        rendered_dataset(load_demo(), tokenizer)


def test_the_rewards_judge_text_and_chat_completions_alike():
    from bench.trl_side import JudgedReward

    reward = JudgedReward("hard_format", "<think>")
    text = "2 + 3 = 5</think><answer>5</answer>"
    assert reward(["q"], [text]) == reward(["q"], [[{"role": "assistant", "content": text}]]) == [1.0]


def test_trl_runs_our_learner_s_optimizer_and_schedule():
    import torch

    from bench.trl_side import LearnerSchedule, load_demo, optimizer_arguments
    from services.learner.optimizer import lr_lambda

    learner = load_demo()["learner"]
    arguments = optimizer_arguments(learner)
    assert arguments["learning_rate"] == learner["lr"] and arguments["warmup_steps"] == learner["warmup_steps"]
    assert arguments["adam_beta2"] == 0.99 and arguments["lr_scheduler_kwargs"] == {"min_lr_rate": 0.5}

    class Args:  # TrainingArguments' two fields the schedule reads
        lr_scheduler_kwargs = arguments["lr_scheduler_kwargs"]

        def get_warmup_steps(self, num_training_steps: int) -> int:
            return arguments["warmup_steps"]

    trainer = LearnerSchedule()
    trainer.args, trainer.lr_scheduler = Args(), None
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=arguments["learning_rate"])
    schedule = trainer.create_scheduler(num_training_steps=20, optimizer=optimizer)
    seen = []
    for _ in range(20):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == [learner["lr"] * lr_lambda(step, 3, 20, 0.5) for step in range(20)]
    assert seen[0] == pytest.approx(learner["lr"] / 3) and seen[-1] > learner["lr"] / 2


def test_the_reward_figure_gives_each_seed_one_colour_and_each_system_one_line_style(tmp_path):
    seeds = list(range(12))  # past the ten-colour cycle: the colours repeat only there
    rows = [{"rewards": [0.1 * seed, 0.2]} for seed in seeds]
    figure = bench.draw(tmp_path / "curves.png", {"TRL GRPOTrainer": rows, "ours": rows}, seeds)
    lines = figure.axes[0].get_lines()
    assert (tmp_path / "curves.png").stat().st_size > 0
    trl, ours = lines[: len(seeds)], lines[len(seeds) :]
    assert [line.get_color() for line in trl] == [line.get_color() for line in ours]
    assert len({line.get_color() for line in trl}) == 10
    assert {line.get_linestyle() for line in trl} == {"-"} and {line.get_linestyle() for line in ours} == {"--"}
    assert ours[4].get_label() == "ours, seed 4"
