/* gen_model: a generated model (src/model/genmodel.h) loaded from memory, for the C tests that
 * run the forward pass or a backend on one. Shared so every test builds and opens it alike. */
#ifndef FITM_TEST_GEN_MODEL_H
#define FITM_TEST_GEN_MODEL_H

#include <stdio.h>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/genmodel.h"
#include "model/model.h"

/* The model cfg describes, opened on a buffer written in memory: *buf (malloc'd, NULL on
 * failure) must outlive the model and is freed by the caller after fitm_model_close. NULL, with
 * the reason on stderr, when building or loading fails. */
__attribute__((unused)) static fitm_model *gen_model_load(const fitm_gen_config *cfg, void **buf)
{
    fitm_gguf_writer *w = NULL;
    fitm_err err = {{0}};
    size_t n = 0;
    fitm_gguf *g = NULL;
    fitm_model *m = NULL;
    *buf = NULL;
    if (fitm_gen_build(cfg, &w, &err) || fitm_gguf_writer_write_memory(w, buf, &n, &err) ||
        fitm_gguf_open_memory(&g, *buf, n, &err) || fitm_model_from_gguf(&m, g, &err)) {
        fprintf(stderr, "generated model: %s\n", err.msg);
        m = NULL;
    }
    fitm_gguf_writer_destroy(w);
    return m;
}

#endif
