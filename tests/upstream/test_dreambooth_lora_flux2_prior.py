# coding=utf-8
# Copyright 2026 HuggingFace Inc.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Port of the prior-preservation cases of diffusers' examples/dreambooth/test_dreambooth_lora_flux2.py and
test_dreambooth_lora_flux2_klein.py, run offline against our script.

These are the only prior-preservation cases diffusers' dreambooth tests have: at huggingface/diffusers @ 58eb52c0 no
``test_dreambooth*.py`` passes ``--with_prior_preservation``; commit bc6fae68 ("Add Flux2 DreamBooth prior
preservation tests", pull request #13857) adds ``test_dreambooth_lora_flux2_prior_preservation_batch_size_two`` and
``test_dreambooth_lora_flux2_klein_prior_preservation_batch_size_two``. Both are here with every flag and assertion
(the other tests of those files, without prior preservation, are not part of this port).

Substitutions (the only changes):

* ``run_command(self._launch_args + [script, *flags])``: instead of an ``accelerate launch`` subprocess of upstream's
  train_dreambooth_lora_flux2{,_klein}.py, our train_text_to_image_lora_arb.py runs in this process with the same
  flags (tests/upstream/_upstream.py);
* Hub ids -> tiny local pipelines built once per test run: ``hf-internal-testing/tiny-flux2`` and
  ``hf-internal-testing/tiny-flux2-klein`` -> hf_arb.testing.tiny_flux2 with a transformer that takes one stacked
  text-encoder layer (``text_layers=1``), as upstream's tiny models do for the tests' ``--text_encoder_out_layers 1``;
* ``--instance_data_dir docs/source/en/imgs`` (also the ``--class_data_dir``) -> a local folder of 5 photos of 5
  aspect ratios, no captions (tests/upstream/conftest.py), so ``--num_class_images 2`` generates nothing, as upstream;
* ``self.assertTrue(x)`` -> ``assert x`` (the pull request's files were unittest classes, the ported files are
  pytest classes, as upstream's current files), and the klein class is named ``Test...`` so pytest collects it (the
  pull request's is ``DreamBoothLoRAFlux2Klein``);
* ``from test_examples_utils import ...`` -> ``from _upstream import ...``; upstream's module-level DEBUG logging to
  stdout is left out (it floods an in-process run)."""

import os
import tempfile

import pytest
from _upstream import HUB, ExamplesTestsAccelerate, run_command  # noqa: E402


def _tiny_flux2_one_layer(root, klein):
    from hf_arb.testing.tiny_flux2 import save_tiny_flux2

    return {"path": save_tiny_flux2(root / "model", klein=klein, text_layers=1)}


@pytest.fixture(autouse=True)
def tiny_flux2_hub(shared_artifact):
    HUB["hf-internal-testing/tiny-flux2"] = shared_artifact(
        "upstream-tiny-flux2-1layer", lambda root: _tiny_flux2_one_layer(root, False))["path"]
    HUB["hf-internal-testing/tiny-flux2-klein"] = shared_artifact(
        "upstream-tiny-flux2-klein-1layer", lambda root: _tiny_flux2_one_layer(root, True))["path"]


class TestDreamBoothLoRAFlux2(ExamplesTestsAccelerate):
    instance_data_dir = "docs/source/en/imgs"
    instance_prompt = "dog"
    pretrained_model_name_or_path = "hf-internal-testing/tiny-flux2"
    script_path = "examples/dreambooth/train_dreambooth_lora_flux2.py"
    transformer_layer_type = "single_transformer_blocks.0.attn.to_qkv_mlp_proj"

    def test_dreambooth_lora_flux2_prior_preservation_batch_size_two(self):
        with tempfile.TemporaryDirectory() as tmpdir:
            test_args = f"""
                {self.script_path}
                --pretrained_model_name_or_path {self.pretrained_model_name_or_path}
                --instance_data_dir {self.instance_data_dir}
                --instance_prompt {self.instance_prompt}
                --with_prior_preservation
                --class_data_dir {self.instance_data_dir}
                --class_prompt dog
                --num_class_images 2
                --resolution 64
                --train_batch_size 2
                --gradient_accumulation_steps 1
                --max_train_steps 1
                --learning_rate 5.0e-04
                --scale_lr
                --lr_scheduler constant
                --lr_warmup_steps 0
                --max_sequence_length 8
                --text_encoder_out_layers 1
                --output_dir {tmpdir}
                """.split()

            run_command(self._launch_args + test_args)
            assert os.path.isfile(os.path.join(tmpdir, "pytorch_lora_weights.safetensors"))


class TestDreamBoothLoRAFlux2Klein(ExamplesTestsAccelerate):
    instance_data_dir = "docs/source/en/imgs"
    instance_prompt = "dog"
    pretrained_model_name_or_path = "hf-internal-testing/tiny-flux2-klein"
    script_path = "examples/dreambooth/train_dreambooth_lora_flux2_klein.py"
    transformer_layer_type = "single_transformer_blocks.0.attn.to_qkv_mlp_proj"

    def test_dreambooth_lora_flux2_klein_prior_preservation_batch_size_two(self):
        with tempfile.TemporaryDirectory() as tmpdir:
            test_args = f"""
                {self.script_path}
                --pretrained_model_name_or_path {self.pretrained_model_name_or_path}
                --instance_data_dir {self.instance_data_dir}
                --instance_prompt {self.instance_prompt}
                --with_prior_preservation
                --class_data_dir {self.instance_data_dir}
                --class_prompt dog
                --num_class_images 2
                --resolution 64
                --train_batch_size 2
                --gradient_accumulation_steps 1
                --max_train_steps 1
                --learning_rate 5.0e-04
                --scale_lr
                --lr_scheduler constant
                --lr_warmup_steps 0
                --max_sequence_length 8
                --text_encoder_out_layers 1
                --output_dir {tmpdir}
                """.split()

            run_command(self._launch_args + test_args)
            assert os.path.isfile(os.path.join(tmpdir, "pytorch_lora_weights.safetensors"))
