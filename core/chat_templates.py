"""The tiny model's chat templates: a plain one, and one that renders tools, for a tiny model that calls them.

The tiny model is built by `tiny/`; its templates sit below both it and the run's roles, because the run
recognises the tiny model's tokenizer by its plain template (`app.tasks.trl_environments.tool_tokenizer`). The tool
template writes Qwen2.5's tool-call format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the assistant's turn, each tool result
as `<tool_response>...</tool_response>` in a user turn, `<|im_end|>` closing every turn), so that TRL's own Qwen
response template (`trl.chat_template_utils.qwen3_template`) parses the model's turns. It lists the tools in one
short line (`Tools: add(a,b) submit(answer)`) where Qwen2.5's preamble gives their JSON schemas in about 1,000 of the
tiny tokenizer's tokens, four times the model's context.
"""

EOS = "<|endoftext|>"
END_OF_TURN = "<|im_end|>"  # the tool model's end of sequence, as Qwen2.5's instruct models stop on it

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:"
    "{% for tool in tools %} {{ tool.function.name }}({{ tool.function.parameters.properties | list | join(',') }})"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    '{% for call in message.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
