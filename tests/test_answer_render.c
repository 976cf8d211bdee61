/* test_answer_render: the text of plain generation's prompt (fitm_answer_render) in the chat
 * templates whose turns the session writes itself: Llama 2's (Meta's format: a system message
 * inside the first user turn's <<SYS>> block, EOS and BOS between an answer and the next turn)
 * and the transcript of a model without a template. Their control tokens: </s><s> become the
 * tokenizer's EOS and BOS ids (fitm_answer_plain_prompt). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gen_model.h"
#include "model/backend.h"
#include "pipeline/answer.h"
#include "pipeline/answer_internal.h"
#include "pipeline/session.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *roles;  /* one letter a message: s(ystem) u(ser) a(ssistant) */
    const char *llama2; /* the prompt's text in Llama 2's format             */
    const char *raw;    /* ... as the transcript                              */
} render_case;

static const render_case cases[] = {
    {"u", "[INST] U0 [/INST]", "user: U0\nassistant:"},
    {"su", "[INST] <<SYS>>\nS0\n<</SYS>>\n\nU1 [/INST]", "system: S0\nuser: U1\nassistant:"},
    {"suau", "[INST] <<SYS>>\nS0\n<</SYS>>\n\nU1 [/INST] A2 </s><s>[INST] U3 [/INST]",
     "system: S0\nuser: U1\nassistant: A2\nuser: U3\nassistant:"},
    {"ua", "[INST] U0 [/INST] A1 ", "user: U0\nassistant: A1\nassistant:"},
    /* a system message after an answer joins the next turn, after the EOS and BOS */
    {"uasu", "[INST] U0 [/INST] A1 </s><s>[INST] <<SYS>>\nS2\n<</SYS>>\n\nU3 [/INST]",
     "user: U0\nassistant: A1\nsystem: S2\nuser: U3\nassistant:"},
    /* two system messages in a row: the first has a turn of its own */
    {"ssu", "[INST] <<SYS>>\nS0\n<</SYS>>\n\n [/INST][INST] <<SYS>>\nS1\n<</SYS>>\n\nU2 [/INST]",
     "system: S0\nsystem: S1\nuser: U2\nassistant:"},
    {"s", "[INST] <<SYS>>\nS0\n<</SYS>>\n\n [/INST]", "system: S0\nassistant:"},
};

static fitm_session *session(const fitm_model *m, const fitm_tokenizer *tok, fitm_backend *b,
                             const char *tmpl)
{
    fitm_session_params p = {.n_ctx = 256, .chunk = 64, .chat_template = tmpl, .dummy_text = "x"};
    fitm_session *s = NULL;
    fitm_err err = {{0}};
    CHECK(fitm_session_create(&s, m, tok, b, &p, &err) == FITM_OK, " %s: %s", tmpl, err.msg);
    return s;
}

/* The case's conversation: message k has the role of letter k and the content "<ROLE>k". */
static void conversation(const render_case *c, fitm_answer_message *msgs, char text[][16],
                         fitm_answer_request *req)
{
    memset(req, 0, sizeof *req);
    int32_t n = (int32_t)strlen(c->roles);
    for (int32_t k = 0; k < n; k++) {
        const char r = c->roles[k];
        snprintf(text[k], 16, "%c%d", r == 's' ? 'S' : r == 'u' ? 'U' : 'A', (int)k);
        msgs[k].role = (char *)(r == 's' ? "system" : r == 'u' ? "user" : "assistant");
        msgs[k].content = text[k];
    }
    req->messages = msgs;
    req->n_messages = n;
}

int main(void)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    void *buf = NULL;
    fitm_model *m = gen_model_load(&cfg, &buf);
    fitm_tokenizer *tok = NULL;
    fitm_backend *b = NULL;
    fitm_err err = {{0}};
    CHECK(m && fitm_tok_create(&tok, fitm_model_gguf(m), &err) == FITM_OK, " %s", err.msg);
    CHECK(fitm_backend_cpu_create(&b, 1, &err) == FITM_OK, " %s", err.msg);
    if (failures)
        return 1;
    fitm_session *llama2 = session(m, tok, b, "llama2"), *raw = session(m, tok, b, "raw");
    const int32_t bos = fitm_tok_bos(tok), eos = fitm_tok_eos(tok);
    CHECK(bos >= 0 && eos >= 0, "the generated vocabulary has BOS and EOS");
    for (size_t i = 0; llama2 && raw && i < sizeof cases / sizeof cases[0]; i++) {
        fitm_answer_message msgs[8];
        char text[8][16];
        fitm_answer_request req;
        conversation(&cases[i], msgs, text, &req);
        for (int t = 0; t < 2; t++) {
            const char *want = t ? cases[i].raw : cases[i].llama2;
            char *got = NULL;
            size_t len = 0;
            CHECK(fitm_answer_render(t ? raw : llama2, &req, &got, &len, &err) == FITM_OK,
                  " %s", err.msg);
            CHECK(got && len == strlen(want) && !strcmp(got, want), "%s %s: '%s', want '%s'",
                  t ? "raw" : "llama2", cases[i].roles, got ? got : "", want);
            free(got);
        }
        /* the tokens: BOS first; </s><s> as EOS then BOS, once per answer followed by a turn */
        fitm_answer_result res = {0};
        int64_t T = 0;
        CHECK(fitm_answer_plain_prompt(llama2, &req, &T, &res, &err) == FITM_OK, " %s",
              err.msg);
        int turns_after_answer = 0, eos_bos = 0;
        for (const char *r = cases[i].roles; *r; r++)
            turns_after_answer += r[0] == 'a' && r[1];
        for (int64_t k = 0; k + 1 < T; k++)
            eos_bos += res.tokens[k] == eos && res.tokens[k + 1] == bos;
        CHECK(T > 0 && res.tokens[0] == bos, "%s: BOS first", cases[i].roles);
        CHECK(eos_bos == turns_after_answer, "%s: %d EOS BOS pairs, want %d", cases[i].roles,
              eos_bos, turns_after_answer);
        free(res.tokens);
    }
    fitm_session_destroy(llama2);
    fitm_session_destroy(raw);
    fitm_backend_destroy(b);
    fitm_tok_destroy(tok);
    fitm_model_close(m);
    free(buf);
    printf("answer_render: %d checks, %d failures\n", n_checks, failures);
    return failures ? 1 : 0;
}
