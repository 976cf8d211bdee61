/* fitm: command-line tools around the model (inspect, tokenize, generate, mkmodel, ...). */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "fitm_config.h"

static const struct {
    const char *name;
    fitm_cli_fn fn;
    const char *help;
} commands[] = {
    /* rows: {"name", fitm_cli_name, "one-line help"}, */
    {"inspect", fitm_cli_inspect, "show a GGUF file's architecture, hyper-parameters, tokenizer, tensors"},
    {"mkmodel", fitm_cli_mkmodel, "write a tiny random GGUF model (llama, qwen2, gemma3)"},
    {"tokenize", fitm_cli_tokenize, "print the token ids of a text (or, with --decode, the text of ids)"},
    {"generate", fitm_cli_generate, "greedy continuation of a prompt (text or --ids)"},
    {"pull", fitm_cli_pull, "download a model over http(s): resumes, retries, checks --sha256"},
    {NULL, NULL, NULL},
};

static void usage(FILE *f)
{
    fprintf(f, "fitm %s — found-in-the-middle tools\n\nusage: fitm COMMAND [options]\n\ncommands:\n",
            FITM_VERSION);
    for (int i = 0; commands[i].name; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "  %-10s %s\n", "version", "print the version");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        printf("fitm %s (cuda: %s)\n", FITM_VERSION, FITM_HAVE_CUDA ? "built" : "not built");
        return 0;
    }
    for (int i = 0; commands[i].name; i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fitm: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
