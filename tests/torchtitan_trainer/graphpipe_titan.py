"""The config module torchtitan's Trainer reads (``--module graphpipe_titan --config F``):
llama3's and DeepSeek-V3's (MoE) debugmodels with graphpipe's pipelining_fn, eager and
captured, and torch's stock."""

from __future__ import annotations

import functools

from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from graphpipe.integrations.torchtitan import pipelining_fn


def graphpipe_debugmodel():
    config = llama3_debugmodel()
    config.model_spec.pipelining_fn = functools.partial(pipelining_fn, capture=None)
    return config


def graphpipe_debugmodel_captured():
    config = llama3_debugmodel()
    config.model_spec.pipelining_fn = functools.partial(pipelining_fn, capture="step")
    return config


def stock_debugmodel():
    return llama3_debugmodel()


def stock_deepseek_v3():
    return deepseek_v3_debugmodel()


def graphpipe_deepseek_v3():
    config = deepseek_v3_debugmodel()
    config.model_spec.pipelining_fn = functools.partial(pipelining_fn, capture=None)
    return config


def graphpipe_deepseek_v3_captured():
    config = deepseek_v3_debugmodel()
    config.model_spec.pipelining_fn = functools.partial(pipelining_fn, capture="step")
    return config
