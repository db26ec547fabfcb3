"""A self teacher's privileged prompt: how a template is filled (text and chat prompts), and what is refused at start
(a field the task lacks or leaves empty, a template that is none or shows nothing privileged), each in one line."""

import pytest

from app.tasks.privileged import check_context, privileged_problem, privileged_prompt
from app.tasks.problems import Problem
from core.config.context import check_template, template_fields

ADDITION = Problem("train-12+45", "Compute 12+45. Answer: ", "57", {"difficulty": "easy"})


def test_a_template_fills_the_prompt_and_the_problems_fields():
    assert privileged_prompt("Hint: {answer}\n{prompt}", ADDITION) == "Hint: 57\nCompute 12+45. Answer: "
    assert privileged_prompt("{prompt}", ADDITION) == ADDITION.prompt
    assert privileged_prompt("({difficulty}) {prompt}", ADDITION) == "(easy) Compute 12+45. Answer: "
    assert privileged_prompt("{feedback}|{prompt}", ADDITION, feedback="wrong: 56") == "wrong: 56|" + ADDITION.prompt
    worked = Problem("p", "Q?", "4", completion="2+2=4")
    assert privileged_prompt("{solution}\n{prompt}", worked) == "2+2=4\nQ?"
    shown = privileged_problem("Hint: {answer}\n{prompt}", ADDITION)
    assert (shown.id, shown.answer, shown.prompt) == (ADDITION.id, "57", "Hint: 57\nCompute 12+45. Answer: ")


def test_a_chat_prompt_has_its_last_user_message_filled():
    chat = Problem("c", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}], "4")
    assert privileged_prompt("{prompt} (answer: {answer})", chat) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q? (answer: 4)"},
    ]
    assert chat.prompt[1]["content"] == "Q?"  # the student's own prompt is left as it was


def test_a_template_naming_what_the_task_lacks_is_one_line_at_start():
    check_context("Hint: {answer}\n{prompt}", [ADDITION], "context")
    with pytest.raises(ValueError, match=r"names hint, which problem 'train-12\+45' of the task does not have") as e:
        check_context("{hint} {prompt}", [ADDITION], "context")
    assert "\n" not in str(e.value) and "answer" in str(e.value)  # one line, saying what the problems have
    with pytest.raises(ValueError, match="does not have"):
        check_context("{solution} {prompt}", [ADDITION], "context")  # arithmetic gives no worked solution
    with pytest.raises(ValueError, match="has no answer to show the teacher"):
        check_context("{answer} {prompt}", [Problem("x", "Q?", "")], "context")
    check_context("{feedback}{prompt}", [ADDITION], "context")  # feedback is filled by the episode, not the task


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{answer}", "must show the student's prompt"),
        ("{prompt}", "nothing the student is not shown"),
        ("{prompt", "is not a template"),
        ("{} {prompt}", "is not a field name"),
        ("{answer.x} {prompt}", "is not a field name"),
    ],
)
def test_a_template_that_is_none_is_refused(template, why):
    with pytest.raises(ValueError, match=why):
        check_template(template)


def test_template_fields():
    assert template_fields("Hint: {answer}\n{prompt} {{literal}}") == {"answer", "prompt"}
