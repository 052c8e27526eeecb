"""Chat templates that use tools, written for the tool-calling tests in the two shapes real checkpoints take:
`HERMES` renders calls as Qwen3's `<tool_call>` JSON (arguments through `tojson`, or as given when a string),
`XML` as Qwen3.5's `<function=...>` form, iterating `arguments|items` (so it needs arguments as objects). Both
list the tools as JSON lines, answer tool messages with `<tool_response>` blocks inside a user turn, and use
HF idioms (namespace, loop.previtem, `is string`, `tojson`)."""

HERMES = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools you can call (JSON schemas):\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nTo call one, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- continue %}{%- endif %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

XML = """\
{%- set ns = namespace(system='') %}
{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool.function | tojson) }}{%- endfor %}
{{- '\\n</tools>' + ('\\n\\n' + ns.system if ns.system else '') + '<|im_end|>\\n' }}
{%- elif ns.system %}
{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- continue %}{%- endif %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# no tools in sight: the "default" of a checkpoint whose tool use lives in a template named "tool_use"
PLAIN = """\
{%- for message in messages %}{{- message.role + ': ' + (message.content or '') + '\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}
"""
